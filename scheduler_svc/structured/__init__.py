"""Structured outputs: JSON-schema, regex, choice and grammar constraints
compiled to token masks by llguidance, without torch (docs/design.md, section 12).

    vocab = GrammarVocab.from_model_tokenizer(tokenizer)         # once
    compiler = GrammarCompiler(vocab)                             # once; LRU of compiled grammars
    grammar = await compiler.compile_async(Constraint.json_schema(schema))   # per request
    matcher = GrammarMatcher(grammar)                             # per request
    masks = await filler.fill_async([matcher, ...])               # per step, rows that need_mask
    matcher.advance(token)                                        # per sampled token
    if matcher.is_complete: ...finish_reason stop
"""

from scheduler_svc.structured.bitmask import allowed_ids, apply_bitmask, pack, unpack
from scheduler_svc.structured.compiler import CompiledGrammar, GrammarCompiler
from scheduler_svc.structured.constraint import Constraint, ConstraintKind
from scheduler_svc.structured.errors import ConstraintRejected, GrammarFailed, TokenRejected
from scheduler_svc.structured.fill import MaskFiller, MaskRows
from scheduler_svc.structured.grammars import Grammars
from scheduler_svc.structured.matcher import GrammarMatcher
from scheduler_svc.structured.vocab import GrammarVocab, mask_words

__all__ = [
    "CompiledGrammar",
    "Constraint",
    "ConstraintKind",
    "ConstraintRejected",
    "GrammarCompiler",
    "GrammarFailed",
    "GrammarMatcher",
    "GrammarVocab",
    "Grammars",
    "MaskFiller",
    "MaskRows",
    "TokenRejected",
    "allowed_ids",
    "apply_bitmask",
    "mask_words",
    "pack",
    "unpack",
]
