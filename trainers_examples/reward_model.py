"""ppo.py's reward model: a sequence classifier (one label) that scores (question, answer) chats,
served by its own `rollout serve --is-embedding` and asked through POST /classify.

A random classifier scores noise, so without --reward-model-path the example first fits a tiny
one (`rollout tiny-model --num-labels 1`'s) to the toy task's rule: mean squared error against
the fraction of digit tokens, on synthetic answers of every digit share, in plain PyTorch on
transformers' AutoModelForSequenceClassification. The policy then learns from the reward
model alone; the rule's reward is logged next to it, to show whether what the reward model
learned is what the rule wanted.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from example_setup import parse_options
from run_log import progress
from toy_task import QUESTIONS, DigitTask


def add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    r = parser.add_argument_group("reward model")
    r.add_argument(
        "--reward-model-path",
        help="a *ForSequenceClassification checkpoint; default: a tiny one fitted here",
    )
    r.add_argument(
        "--reward-url", help="a running `rollout serve --is-embedding` of it; default: start one"
    )
    r.add_argument("--reward-api-key", help="that server's API key, when it has one")
    r.add_argument("--reward-device", help="the reward server's device (default: the engine's)")
    r.add_argument("--reward-dtype", default="float32", help="the reward server's dtype")
    r.add_argument(
        "--reward-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any other option of the reward server, e.g. mem_fraction=0.2 (repeatable)",
    )
    r.add_argument(
        "--rm-steps",
        type=int,
        default=200,
        help="AdamW steps fitting the tiny reward model to the rule (0: it stays random)",
    )
    r.add_argument("--rm-batch", type=int, default=64, help="synthetic answers per fitting step")
    r.add_argument("--rm-lr", type=float, default=3e-3, help="learning rate of the fit")
    r.add_argument(
        "--server-timeout", type=float, default=300.0, help="seconds to wait for the reward server"
    )


def server_options(args: argparse.Namespace) -> dict[str, Any]:
    """The reward server's engine options: --reward-device/--reward-dtype, --reward-option."""
    options = {"is_embedding": True, "device": args.reward_device, "dtype": args.reward_dtype}
    return {**options, **parse_options(args.reward_option, "--reward-option")}


def conversation(question: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def score(
    client: Any, task: DigitTask, questions: list[str], output_ids: list[list[int]]
) -> torch.Tensor:
    """[len(output_ids)] the reward model's score of each answer to its question, in one
    /classify call. The answers go as text, so that a reward model with its own tokenizer and
    chat template scores them as it was trained to."""
    answers = [task.tokenizer.decode(ids, skip_special_tokens=True) for ids in output_ids]
    outputs = client.classify(messages=[conversation(q, a) for q, a in zip(questions, answers)])
    return torch.tensor([o["embedding"][0] for o in outputs])


@contextlib.contextmanager
def reward_checkpoint(
    args: argparse.Namespace, task: DigitTask
) -> Iterator[tuple[str, dict[str, float]]]:
    """args.reward_model_path as it is, or a tiny classifier fitted to the rule in a temporary
    directory; yields the path and the fit's held-out statistics (none for a given model)."""
    if args.reward_model_path:
        yield args.reward_model_path, {}
        return
    from rollout.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="rollout-reward-model-") as tmp:
        path = make_tiny_model(tmp, arch=args.arch, seed=args.seed + 1, num_labels=1)
        yield path, fit_to_rule(path, task, args)


def fit_to_rule(path: str, task: DigitTask, args: argparse.Namespace) -> dict[str, float]:
    """Trains the classifier at `path` to predict task.reward from the chat, args.rm_steps AdamW
    steps of args.rm_batch fresh synthetic answers each, and saves it back to `path`. Returns
    the mean squared error and the correlation with the rule on held-out answers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    model.to(args.trainer_device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.rm_lr, weight_decay=0.0)
    examples = SyntheticAnswers(
        task, AutoTokenizer.from_pretrained(path), args.max_new_tokens, args.seed
    )
    held_out = examples.batch(256, args.trainer_device)
    for _ in progress(args.rm_steps, "reward model"):
        input_ids, attention_mask, target = examples.batch(args.rm_batch, args.trainer_device)
        predicted = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]  # [B]
        loss = torch.nn.functional.mse_loss(predicted, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
    model.eval()
    with torch.no_grad():
        input_ids, attention_mask, target = held_out
        predicted = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]
    model.save_pretrained(path, safe_serialization=True)
    return {
        "rm_fit_mse": torch.nn.functional.mse_loss(predicted, target).item(),
        "rm_fit_corr": torch.corrcoef(torch.stack([predicted, target]))[0, 1].item(),
    }


class SyntheticAnswers:
    """Chats of a random question and a random answer: up to max_tokens tokens, a uniformly
    random share of them digit tokens, the rest any other non-special tokens, so that the
    reward model sees every reward from 0 to 1 (a random policy alone writes almost no digits)."""

    def __init__(self, task: DigitTask, rm_tokenizer: Any, max_tokens: int, seed: int) -> None:
        self.task, self.rm_tokenizer, self.max_tokens = task, rm_tokenizer, max_tokens
        self.digits = sorted(task.digit_ids)
        special = set(task.tokenizer.all_special_ids)
        self.others = [
            i for i in range(len(task.tokenizer)) if i not in task.digit_ids and i not in special
        ]
        self.rng = random.Random(seed)

    def sample(self) -> tuple[list[int], float]:
        """(the chat's token ids for the reward model, the rule's reward of the answer)"""
        length = self.rng.randint(0, self.max_tokens)
        num_digits = self.rng.randint(0, length)
        answer = [self.rng.choice(self.digits) for _ in range(num_digits)]
        answer += [self.rng.choice(self.others) for _ in range(length - num_digits)]
        self.rng.shuffle(answer)
        chat = conversation(self.rng.choice(QUESTIONS), self.task.tokenizer.decode(answer))
        # As the server tokenizes /classify's messages: the template writes the special tokens.
        text = self.rm_tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=False
        )
        return self.rm_tokenizer.encode(text, add_special_tokens=False), self.task.reward(answer)

    def batch(
        self, size: int, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids and attention_mask [B, L] (right-padded with the pad token, where the
        classifier looks for each chat's last token), target rewards [B]."""
        samples = [self.sample() for _ in range(size)]
        length = max(len(ids) for ids, _ in samples)
        input_ids = torch.full((size, length), self.rm_tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(size, length, dtype=torch.long)
        for row, (ids, _) in enumerate(samples):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        target = torch.tensor([reward for _, reward in samples])
        return input_ids.to(device), attention_mask.to(device), target.to(device)
