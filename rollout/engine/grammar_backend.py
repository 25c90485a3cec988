"""GrammarBackend: compiles a request's grammar against the model's vocabulary (xgrammar), off
the step loop, and makes each request's matcher.

Compiled grammars are cached by xgrammar's compiler (keyed by the grammar's text and options),
so the n samples of a request and the prompts of an RL batch that share a schema compile once.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rollout.engine.grammar_matcher import RequestGrammar
from rollout.engine.grammar_spec import JSON_ANY_WHITESPACE, GrammarSpec, import_xgrammar

COMPILE_THREADS = 2  # xgrammar's own threads for one compilation


class GrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        """vocab_size: the model's (its logits' width), which may exceed the tokenizer's; the
        ids past the tokenizer are never allowed. The grammar ends on any of eos_token_ids."""
        xgr = import_xgrammar()
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=True)
        # One compilation at a time: each already runs on COMPILE_THREADS threads.
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def compile(self, spec: GrammarSpec) -> Any:
        """The xgrammar CompiledGrammar of `spec` (from the cache when compiled before)."""
        c = self.compiler
        if spec.kind == "json_schema":
            return c.compile_json_schema(spec.text, any_whitespace=JSON_ANY_WHITESPACE)
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "ebnf":
            return c.compile_grammar(spec.text)
        if spec.kind == "structural_tag":
            return c.compile_structural_tag(spec.text)
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def submit(self, spec: GrammarSpec) -> Future:
        """Compiles on the backend's thread; the future's result is a fresh RequestGrammar."""
        return self.pool.submit(self.matcher, spec)

    def matcher(self, spec: GrammarSpec) -> RequestGrammar:
        """A new request's grammar state: at the grammar's start, no token accepted."""
        return RequestGrammar(self.compile(spec), self.vocab_size)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
