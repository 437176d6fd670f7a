"""The grammar engine (scheduler_svc/structured) on real tokenizers: masks,
matchers, compile errors naming the field, the compile cache and its time
bound, the batch fill, and the numpy reference of applying a mask."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading

import jsonschema
import llguidance
import numpy as np
import pytest

from bench.structured_schemas import REAL_SCHEMAS
from scheduler_svc.structured import (
    Constraint,
    ConstraintRejected,
    GrammarCompiler,
    GrammarFailed,
    GrammarMatcher,
    GrammarVocab,
    MaskFiller,
    TokenRejected,
    allowed_ids,
    apply_bitmask,
    pack,
    unpack,
)
from scheduler_svc.structured.bitmask import allowed_count
from tests.helpers.grammar_walk import TINY_EOS, default_vocab, random_walk, tiny_vocab


@pytest.fixture(scope="module", params=["default", "tiny"])
def vocab(request) -> GrammarVocab:
    return default_vocab() if request.param == "default" else tiny_vocab()


@pytest.fixture(scope="module")
def compiler(vocab) -> GrammarCompiler:
    compiler = GrammarCompiler(vocab)
    yield compiler
    compiler.close()


def _matcher(compiler: GrammarCompiler, constraint: Constraint, **kwargs) -> GrammarMatcher:
    return GrammarMatcher(compiler.compile(constraint), **kwargs)


def _feed(matcher: GrammarMatcher, text: str) -> None:
    for token in matcher.vocab.encode(text):
        matcher.advance(token)


# ---- masks and matchers ---------------------------------------------------------


def test_a_mask_covers_the_logits_width_and_allows_no_id_past_the_tokenizer():
    # A model whose logits are wider than its tokenizer (padded embeddings).
    vocab = tiny_vocab(logits_width=800)
    assert vocab.vocab_size == 800 and vocab.mask_words == 25
    matcher = _matcher(GrammarCompiler(vocab), Constraint.regex(r"[a-z ]+"))
    mask = matcher.mask()
    assert mask.shape == (25,) and mask.dtype == np.int32
    assert not unpack(mask, 800)[0, 768:].any()
    allowed = allowed_ids(mask, 800)
    assert len(allowed) > 20
    assert all(re.fullmatch(r"[a-z ]+", vocab.decode([int(t)])) for t in allowed)


def test_json_schema_walk_ends_complete_in_valid_json(compiler):
    schema = REAL_SCHEMAS["weather_tool"]
    walk = random_walk(_matcher(compiler, Constraint.json_schema(schema)), random.Random(3))
    assert walk.ended_by == "complete"
    jsonschema.validate(json.loads(walk.text), schema)


@pytest.mark.parametrize("name", sorted(REAL_SCHEMAS))
def test_real_schemas_compile_and_random_walks_validate(compiler, name):
    grammar = compiler.compile(Constraint.json_schema(REAL_SCHEMAS[name]))
    for seed in range(2):
        walk = random_walk(GrammarMatcher(grammar), random.Random(seed))
        jsonschema.validate(json.loads(walk.text), REAL_SCHEMAS[name])


def test_the_matcher_follows_text_and_completes(compiler):
    matcher = _matcher(compiler, Constraint.json_schema(REAL_SCHEMAS["weather_tool"]))
    assert matcher.needs_mask and not matcher.can_end
    _feed(matcher, '{"location": "Paris, France", "unit": "celsius", "days": 3}')
    assert matcher.is_complete and matcher.can_end
    # Nothing but EOS may follow.
    assert list(allowed_ids(matcher.mask(), matcher.vocab.vocab_size)) == list(matcher.vocab.eos_token_ids)


def test_a_forbidden_token_is_rejected_and_leaves_the_matcher_as_it_was(compiler):
    matcher = _matcher(compiler, Constraint.json_schema(REAL_SCHEMAS["weather_tool"]))
    _feed(matcher, '{"location": "Oslo"')
    before = matcher.mask().copy()
    bad = matcher.vocab.encode("}")[0]  # "unit" and "days" are required
    assert not matcher.allows(bad)
    with pytest.raises(TokenRejected, match=f"token {bad} is not allowed"):
        matcher.advance(bad)
    assert np.array_equal(matcher.mask(), before) and matcher.error is None
    eos = matcher.vocab.eos_token_ids[0]
    assert not matcher.allows(eos)  # an unfinished object cannot end
    _feed(matcher, ', "unit": "fahrenheit", "days": 14}')
    assert matcher.is_complete


def test_rollback_restores_the_earlier_masks(compiler):
    matcher = _matcher(compiler, Constraint.json_schema(REAL_SCHEMAS["invoice"]))
    masks, rng = [], random.Random(5)
    for _ in range(30):
        mask = matcher.mask()
        masks.append(mask.copy())
        matcher.advance(int(rng.choice(allowed_ids(mask, matcher.vocab.vocab_size))))
    for k in (1, 4, 10):
        matcher.rollback(k)
        assert np.array_equal(matcher.mask(), masks[matcher.num_tokens])
    assert matcher.num_tokens == 15
    matcher.rollback(15)
    assert np.array_equal(matcher.mask(), masks[0])


def test_eos_ends_a_grammar_that_may_go_on(compiler):
    matcher = _matcher(compiler, Constraint.regex(r"(ab)+"))
    _feed(matcher, "ab")
    eos = matcher.vocab.eos_token_ids[0]
    assert matcher.can_end and not matcher.is_complete and matcher.allows(eos)
    _feed(matcher, "abab")
    matcher.advance(eos)
    assert matcher.is_complete


def test_regex_and_choice_walks_match(compiler):
    pattern = r"(yes|no|maybe)-[0-9]{2,4}( [A-Z][a-z]{0,5})?"
    for seed in range(5):
        walk = random_walk(_matcher(compiler, Constraint.regex(pattern)), random.Random(seed))
        assert re.fullmatch(pattern, walk.text), walk.text
    choices = ['say "hi"', "naïve 🙂", "a\\b", "yes", "yes!"]
    seen = set()
    for seed in range(12):
        walk = random_walk(_matcher(compiler, Constraint.choice(choices)), random.Random(seed))
        assert walk.text in choices
        seen.add(walk.text)
    assert len(seen) >= 3


def test_grammars_in_lark_and_gbnf(compiler):
    lark = 'start: "(" expr ")"\nexpr: NUM | NUM "+" expr\nNUM: /[0-9]{1,3}/'
    gbnf = 'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [0-9] | [0-9] [0-9]'
    for text, form in ((lark, r"\([0-9]{1,3}(\+[0-9]{1,3})*\)"), (gbnf, r"\([0-9]{1,2}(\+[0-9]{1,2})*\)")):
        for seed in range(3):
            walk = random_walk(_matcher(compiler, Constraint.grammar(text)), random.Random(seed))
            assert re.fullmatch(form, walk.text), walk.text


def test_json_object_is_any_object_written_compactly(compiler):
    matcher = _matcher(compiler, Constraint.json_object())
    _feed(matcher, '{"a": [1, 2.5, {"b": null}], "c": "d"}')
    assert matcher.is_complete
    matcher = _matcher(compiler, Constraint.json_object())
    _feed(matcher, "{")
    # The style is json.dumps': no newline or indentation to pad with.
    assert not matcher.allows(matcher.vocab.encode("\n")[0])


def test_the_grammar_starts_after_the_reasoning(compiler):
    vocab = compiler.vocab
    end_think = vocab.encode("</think>\n")
    matcher = _matcher(compiler, Constraint.choice(["red", "blue"]), activate_after=end_think)
    assert not matcher.needs_mask and matcher.can_end
    _feed(matcher, "I think }{ the answer is ")
    assert not matcher.active
    for token in end_think:
        matcher.advance(token)
    assert matcher.needs_mask and not matcher.can_end
    _feed(matcher, "blue")
    assert matcher.is_complete
    # Rolling back into the reasoning switches the grammar off again.
    matcher.rollback(len(vocab.encode("blue")) + 1)
    assert not matcher.active
    matcher.advance(end_think[-1])
    assert matcher.active and not matcher.can_end


# ---- errors name the field -----------------------------------------------------


@pytest.mark.parametrize(
    ("make", "field", "message"),
    [
        (lambda: Constraint.json_schema("{not json"), "structured_output.json_schema", "not valid JSON"),
        (lambda: Constraint.json_schema("[1, 2]"), "structured_output.json_schema", "a schema is a JSON object"),
        (lambda: Constraint.json_schema({"type": "foo"}), "structured_output.json_schema", "Invalid type"),
        (lambda: Constraint.json_schema({"type": "string", "if": {}}), "structured_output.json_schema", "if"),
        (
            lambda: Constraint.json_schema({"$ref": "#/$defs/missing"}),
            "structured_output.json_schema",
            "missing",
        ),
        (lambda: Constraint.regex("a(b"), "structured_output.regex", "unclosed group"),
        (lambda: Constraint.regex("(?=a)a"), "structured_output.regex", "look-around"),
        (lambda: Constraint.choice([]), "structured_output.choice", "1 to 1024 choices"),
        (lambda: Constraint.choice(["a", ""]), "structured_output.choice", "non-empty string"),
        (lambda: Constraint.grammar("start: foo"), "structured_output.grammar", "unknown name"),
        (lambda: Constraint.grammar("root ::= ("), "structured_output.grammar", ""),
        (lambda: Constraint.grammar("   "), "structured_output.grammar", "empty"),
        (lambda: Constraint.grammar("start: <|no_such_token|>"), "structured_output.grammar", ""),
    ],
)
def test_a_bad_constraint_is_rejected_naming_the_field(compiler, make, field, message):
    with pytest.raises(ConstraintRejected) as caught:
        compiler.compile(make())
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")
    assert message in caught.value.message


def test_a_lenient_schema_ignores_what_a_strict_one_refuses(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "if": {}}}, "required": ["a"]}
    with pytest.raises(ConstraintRejected, match="structured_output.json_schema"):
        compiler.compile(Constraint.json_schema(schema, strict=True))
    matcher = _matcher(compiler, Constraint.json_schema(schema, strict=False))
    _feed(matcher, '{"a": 12}')
    assert matcher.is_complete


# ---- the cache and the time bound ----------------------------------------------


def test_compiled_grammars_are_cached_per_constraint_and_vocabulary():
    compiler = GrammarCompiler(tiny_vocab(), cache_size=2)
    first = compiler.compile(Constraint.json_schema(REAL_SCHEMAS["person"]))
    # The same schema spaced differently is the same constraint.
    again = compiler.compile(Constraint.json_schema(json.dumps(REAL_SCHEMAS["person"], indent=2)))
    assert again is first and (compiler.stats.hits, compiler.stats.misses) == (1, 1)
    # ...but with its properties in another order it is another grammar (generated in order).
    reordered = dict(reversed(list(REAL_SCHEMAS["person"].items())))
    reordered["properties"] = dict(reversed(list(REAL_SCHEMAS["person"]["properties"].items())))
    assert compiler.compile(Constraint.json_schema(reordered)) is not first
    # A failure is cached too: a bad schema sent again is not compiled again.
    for _ in range(2):
        with pytest.raises(ConstraintRejected):
            compiler.compile(Constraint.regex("a(b"))
    assert compiler.stats.misses == 3 and compiler.stats.size == 2  # LRU: the person schema is gone
    assert compiler.compile(Constraint.json_schema(REAL_SCHEMAS["person"])) is not first
    other = GrammarCompiler(default_vocab())
    assert other.compile(Constraint.json_schema(REAL_SCHEMAS["person"])).vocab is default_vocab()
    assert default_vocab().key != tiny_vocab().key


def test_a_compile_past_the_bound_is_rejected_and_not_cached():
    compiler = GrammarCompiler(tiny_vocab(), timeout_s=0.2)
    release = threading.Event()
    build = compiler._build

    def slow_build(constraint):
        release.wait(10)
        return build(constraint)

    compiler._build = slow_build
    constraint = Constraint.regex("[0-9]+")
    with pytest.raises(ConstraintRejected, match=r"structured_output.regex: the grammar took longer than 0.2 s"):
        compiler.compile(constraint)

    async def wait_async():
        with pytest.raises(ConstraintRejected, match="took longer than"):
            await compiler.compile_async(constraint)

    asyncio.run(wait_async())
    assert compiler.stats.misses == 1  # one compile under way, shared by both callers
    release.set()
    assert GrammarMatcher(compiler.compile(constraint)).needs_mask  # it finished: cached from now on
    compiler.close()


def test_concurrent_requests_share_one_compile():
    compiler = GrammarCompiler(tiny_vocab())
    constraint = Constraint.json_schema(REAL_SCHEMAS["github_issue"])

    async def many():
        return await asyncio.gather(*(compiler.compile_async(constraint) for _ in range(8)))

    grammars = asyncio.run(many())
    assert all(g is grammars[0] for g in grammars) and compiler.stats.misses == 1
    compiler.close()


# ---- batch fill ----------------------------------------------------------------


def test_the_parallel_fill_equals_each_matchers_own_mask(compiler):
    vocab = compiler.vocab
    rng = random.Random(11)
    grammars = [compiler.compile(Constraint.json_schema(s)) for s in REAL_SCHEMAS.values()]
    matchers = []
    for i in range(32):
        matcher = GrammarMatcher(grammars[i % len(grammars)])
        for _ in range(rng.randrange(0, 40)):
            if matcher.is_complete:
                break
            matcher.advance(int(rng.choice(allowed_ids(matcher.mask(), vocab.vocab_size))))
        if matcher.needs_mask and not matcher.is_complete:
            matchers.append(matcher)
    filler = MaskFiller(vocab.mask_words)
    rows = asyncio.run(filler.fill_async(matchers))
    assert rows.bits.shape == (len(matchers), vocab.mask_words) and rows.errors == {}
    for i, matcher in enumerate(matchers):
        assert np.array_equal(rows.bits[i], matcher.mask()), i
    few = filler.fill(matchers[:2])  # the serial path below PARALLEL_MIN_ROWS
    assert np.array_equal(few.bits, rows.bits[:2])
    serial = MaskFiller(vocab.mask_words, threads=0)
    assert np.array_equal(serial.fill(matchers).bits, rows.bits)
    filler.close()
    serial.close()


# ---- the numpy reference of applying a mask -------------------------------------


def test_pack_and_unpack_are_inverse_and_little_endian():
    rng = np.random.default_rng(0)
    allowed = rng.random((3, 70)) < 0.3
    words = pack(allowed, 3)
    assert words.dtype == np.int32 and words.shape == (3, 3)
    assert np.array_equal(unpack(words, 70), allowed)
    one = pack(np.eye(64, dtype=bool)[[31, 32]], 2)
    assert one[0, 0] == np.int32(-(2**31)) and one[0, 1] == 0  # id 31: the sign bit of word 0
    assert one[1, 0] == 0 and one[1, 1] == 1


def test_applying_a_mask_sets_exactly_the_disallowed_logits_to_minus_infinity():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 100)).astype(np.float32)
    allowed = rng.random((4, 90)) < 0.2
    allowed[:, 0] = True
    mask = pack(allowed, 3)  # 96 ids: logits columns 96..99 are past the mask
    masked = apply_bitmask(logits, mask)
    assert masked.dtype == np.float32
    expected_allowed = np.zeros((4, 100), bool)
    expected_allowed[:, :90] = allowed
    assert np.array_equal(np.isfinite(masked), expected_allowed)
    assert np.array_equal(masked[expected_allowed], logits[expected_allowed])
    greedy = masked.argmax(axis=1)
    assert all(expected_allowed[r, t] for r, t in enumerate(greedy))
    assert np.array_equal(logits, logits.copy())  # the raw logits are left for the logprobs
    wider = pack(np.ones((1, 60), bool), 2)
    assert np.isfinite(apply_bitmask(logits[:1, :40], wider)).all()  # bits past the logits: ignored


def test_a_real_mask_applied_to_logits_keeps_only_grammar_tokens():
    vocab = tiny_vocab()
    matcher = GrammarMatcher(GrammarCompiler(vocab).compile(Constraint.choice(["cat", "dog"])))
    logits = np.random.default_rng(2).standard_normal((1, vocab.vocab_size)).astype(np.float32)
    masked = apply_bitmask(logits, matcher.mask())
    kept = np.flatnonzero(np.isfinite(masked[0]))
    assert len(kept) == allowed_count(matcher.mask(), vocab.vocab_size) > 0
    assert all("cat".startswith(vocab.decode([int(t)])) or "dog".startswith(vocab.decode([int(t)])) for t in kept)
    assert TINY_EOS not in kept


def test_a_grammar_that_hits_a_limit_mid_output_fails_its_request_and_is_compiled_afresh():
    # A lexer-state cap low enough that random walks through the issue schema exceed it.
    vocab = tiny_vocab()
    compiler = GrammarCompiler(vocab, limits=llguidance.LLParserLimits(max_lexer_states=200, verbose_errors=False))
    constraint = Constraint.json_schema(REAL_SCHEMAS["github_issue"])
    grammar = compiler.compile(constraint)
    filler = MaskFiller(vocab.mask_words)
    matchers = [GrammarMatcher(grammar) for _ in range(4)]
    rng = random.Random(0)
    failed: dict[int, str] = {}
    for _ in range(300):
        rows = filler.fill(matchers)
        failed.update(rows.errors)
        for i, matcher in enumerate(matchers):
            if i in rows.errors:
                continue
            try:
                matcher.advance(int(rng.choice(allowed_ids(rows.bits[i], vocab.vocab_size))))
            except GrammarFailed as exc:
                failed[i] = str(exc)
        if failed:
            break
    assert failed and all(message.startswith("lexer error: too many states") for message in failed.values())
    assert all("<state>" not in message for message in failed.values())  # llguidance's dump is cut off
    broken = matchers[next(iter(failed))]
    assert broken.error and not broken.needs_mask and not broken.is_complete
    # The cached grammar's lexer is spent: forgetting it gives the next request a fresh one.
    compiler.forget(constraint)
    fresh = compiler.compile(constraint)
    assert fresh is not grammar and GrammarMatcher(fresh).needs_mask
    filler.close()
    compiler.close()
