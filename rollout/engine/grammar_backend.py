"""GrammarBackend: compiles a request's grammar against the model's vocabulary (xgrammar), off
the step loop, and makes each request's matcher.

The vocabulary is each token's bytes as the output's text will have them (grammar_vocab.py),
so there are two: outputs that skip special tokens (the default) and outputs that keep them.
Each is built, with its compiler, the first time a grammar needs it. Compiled grammars are
cached by their compiler (keyed by the grammar's text and options), so the n samples of a
request and the prompts of an RL batch that share a schema compile once.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rollout.engine.grammar_matcher import RequestGrammar
from rollout.engine.grammar_spec import JSON_ANY_WHITESPACE, GrammarSpec, import_xgrammar
from rollout.engine.grammar_vocab import vocab_bytes

COMPILE_THREADS = 2  # xgrammar's own threads for one compilation


class GrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        """vocab_size: the model's (its logits' width), which may exceed the tokenizer's; the
        ids past the tokenizer are never allowed. The grammar ends on any of eos_token_ids.
        Raises InvalidRequest when xgrammar is not installed."""
        self.xgr = import_xgrammar()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.compilers: dict[bool, Any] = {}  # skip_special_tokens -> its GrammarCompiler
        # One compilation at a time: each already runs on COMPILE_THREADS threads.
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def compiler(self, skip_special_tokens: bool) -> Any:
        """The compiler for outputs decoded with `skip_special_tokens`: where they are skipped,
        special tokens add nothing to the text, so no grammar allows them (bar the EOS ids)."""
        if skip_special_tokens not in self.compilers:
            vocab = vocab_bytes(self.tokenizer, self.vocab_size, skip_special_tokens)
            info = self.xgr.TokenizerInfo(
                vocab,
                self.xgr.VocabType.RAW,
                vocab_size=self.vocab_size,
                stop_token_ids=self.eos_token_ids,
            )
            self.compilers[skip_special_tokens] = self.xgr.GrammarCompiler(
                info, max_threads=COMPILE_THREADS, cache_enabled=True
            )
        return self.compilers[skip_special_tokens]

    def compile(self, spec: GrammarSpec, skip_special_tokens: bool = True) -> Any:
        """The xgrammar CompiledGrammar of `spec` (from the cache when compiled before)."""
        c = self.compiler(skip_special_tokens)
        if spec.kind == "json_schema":
            return c.compile_json_schema(spec.text, any_whitespace=JSON_ANY_WHITESPACE)
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "ebnf":
            return c.compile_grammar(spec.text)
        if spec.kind == "structural_tag":
            return c.compile_structural_tag(spec.text)
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def submit(self, spec: GrammarSpec, skip_special_tokens: bool = True) -> Future:
        """Compiles on the backend's thread; the future's result is a fresh RequestGrammar."""
        return self.pool.submit(self.matcher, spec, skip_special_tokens)

    def matcher(self, spec: GrammarSpec, skip_special_tokens: bool = True) -> RequestGrammar:
        """A new request's grammar state: at the grammar's start, no token accepted.
        skip_special_tokens: the request's, which decides what its output's text shows."""
        return RequestGrammar(self.compile(spec, skip_special_tokens), self.vocab_size)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
