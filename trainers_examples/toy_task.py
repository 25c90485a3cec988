"""The examples' task: answer with digits only, scored by a rule (a verifiable reward).

The reward of one sample is the fraction of its generated tokens that are digit tokens (the
final EOS or stop token does not count; an empty answer scores 0). A random tiny model writes
a digit about once in a hundred tokens, so it starts near 0; a policy that learned the task
scores near 1. The prompts ask for numbers, so a real instruct model starts higher and the
same loop still applies.
"""

from __future__ import annotations

from typing import Any

QUESTIONS = [
    "How many days are in a week? Answer with digits only.",
    "Write the year the first person walked on the moon.",
    "What is 6 times 7? Reply with the number.",
    "Count from one to five using digits.",
    "Give me a four digit number.",
    "How many minutes are in an hour?",
    "Write your favourite prime number.",
    "What is 100 divided by 4? Digits only.",
    "How many legs does a spider have?",
    "Write the number twelve as digits.",
    "Add 3 and 4 and write the sum.",
    "How many hours are in a day?",
    "Write the digits of pi you remember.",
    "What is 9 plus 10?",
    "Give me a phone extension of three digits.",
    "How many months are in a year?",
]


class DigitTask:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # A token is a digit token when its text, spaces aside, is all digits ("7", " 42").
        self.digit_ids = frozenset(
            i for i in range(len(tokenizer)) if tokenizer.decode([i]).strip().isdigit()
        )
        if not self.digit_ids:
            raise ValueError("the tokenizer has no digit tokens; this task needs some")
        stops = {tokenizer.eos_token_id, tokenizer.pad_token_id}
        self.stop_ids = frozenset(t for t in stops if t is not None)

    def questions(self, count: int, step: int) -> list[str]:
        """`count` questions, rotating through QUESTIONS by step."""
        if count < 1:
            raise ValueError(f"the number of prompts per step must be >= 1, got {count}")
        return [QUESTIONS[(step * count + i) % len(QUESTIONS)] for i in range(count)]

    def prompts(self, count: int, step: int) -> list[list[int]]:
        """The questions of `step`, chat-formatted (token ids)."""
        return [self.encode(q) for q in self.questions(count, step)]

    def encode(self, question: str) -> list[int]:
        messages = [{"role": "user", "content": question}]
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def reward(self, output_ids: list[int]) -> float:
        """Fraction of digit tokens among the generated ones, a final stop token left out."""
        answer = output_ids[:-1] if output_ids and output_ids[-1] in self.stop_ids else output_ids
        if not answer:
            return 0.0
        return sum(t in self.digit_ids for t in answer) / len(answer)
