"""Wire records: round trips, compatibility rules and clear errors on malformed payloads."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest

from llmbus.engine.sampling_params import SamplingParams
from llmbus.protocol import (
    Abort,
    AllocateRequest,
    ErrorReply,
    GenerateRequest,
    Handoff,
    InstanceInfo,
    Lease,
    LogprobEntry,
    PoolStats,
    ProtocolError,
    ReadReply,
    SamplingSpec,
    StatsRequest,
    TokenEvent,
    WriteRequest,
    decode,
    encode,
)


def _request(**kw) -> GenerateRequest:
    base = dict(request_id="req-1", model="demo", prompt_token_ids=[5, 6, 7],
                sampling=SamplingSpec(max_tokens=4, temperature=0.0, stop_token_ids=[2], logprobs=2, seed=9),
                tenant="acme", cache_salt="s1", priority=3, deadline=1.5e9, created=1.4e9,
                token_subject="llmbus.tok.req-1", kv_format="int8")  # fmt: skip
    base.update(kw)
    return GenerateRequest(**base)


LEASE = Lease("p-1", [4, 2], 512, "llmbus_kv_ab", 30.0, 1.7e9, "kvpool-1")
SAMPLES = [
    _request(),
    TokenEvent("req-1", 3, [11, 12], [LogprobEntry(11, -0.5, [(11, -0.5), (3, -1.25)]), LogprobEntry(12, -0.1)],
               finish_reason="length", prompt_tokens=3, cached_tokens=0, completion_tokens=4, worker="decode-1"),
    TokenEvent.failure("req-2", "boom", seq=1),
    Abort("req-1", "client_disconnected"),
    LEASE,
    AllocateRequest(3, 10.0, "prefill-1", "req-1"),
    WriteRequest("p-1", 512, b"\x00\xffbytes"),
    ReadReply("p-1", 0, b""),
    StatsRequest(),
    PoolStats("kvpool-1", 8, 6, 2, 1, 512, "llmbus_kv_ab", 0),
    Handoff(_request(lane="short"), [42], 3, LEASE, {"request_id": "req-1", "prompt_token_ids": [5, 6, 7],
                                                   "output_token_ids": [42], "nested": {"a": [1.5]}},
            [2, 4, 64], "int8", "prefill-1", 1, 0),
    InstanceInfo("decode-1", "decode", ["demo"], 100, 2, "host", 1.7e9, 1234),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert isinstance(data, bytes)
    assert decode(type(msg), data) == msg


def test_wire_form_is_a_plain_map_by_field_name():
    raw = msgpack.unpackb(encode(_request()), raw=False)
    assert raw["prompt_token_ids"] == [5, 6, 7]
    assert raw["sampling"]["stop_token_ids"] == [2]
    assert list(raw) == [f.name for f in dataclasses.fields(GenerateRequest)]  # declaration order


def test_unknown_keys_ignored_and_missing_appended_fields_defaulted():
    raw = {"request_id": "r", "model": "m", "prompt_token_ids": [1], "field_from_the_future": 1}
    req = decode(GenerateRequest, msgpack.packb(raw))
    assert req.sampling == SamplingSpec() and req.lane == "" and req.kv_format == "model"
    assert decode(TokenEvent, msgpack.packb({"request_id": "r", "seq": 0})).token_ids == []


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\xc1", r"not valid MessagePack \(FormatError\)"),
        (msgpack.packb([1, 2]), "expected a map, got list"),
        (msgpack.packb({"request_id": "r", "prompt_token_ids": [1]}), "missing required field 'model'"),
        (msgpack.packb({"request_id": "r", "model": "m", "prompt_token_ids": "abc"}), "prompt_token_ids: expected a list"),
        (msgpack.packb({"request_id": "r", "model": "m", "prompt_token_ids": [1, "2"]}), r"prompt_token_ids\[1\]: expected an integer"),
        (msgpack.packb({"request_id": "r", "model": "m", "prompt_token_ids": [True]}), "expected an integer, got bool"),
        (msgpack.packb({"request_id": "r", "model": "m", "prompt_token_ids": [-1]}), r"token ids in \[0, 2\*\*31\)"),
        (msgpack.packb({"request_id": "r", "model": "m", "prompt_token_ids": [5, 2**32]}), "got 4294967296"),
        (msgpack.packb({"request_id": "r", "model": "m", "prompt_token_ids": []}), "must not be empty"),
        (msgpack.packb({"request_id": "a.b", "model": "m", "prompt_token_ids": [1]}), "request_id must be 1-128"),
        (msgpack.packb({"request_id": "r", "model": "m", "prompt_token_ids": [1], "sampling": {"temperature": "hot"}}),
         "sampling.temperature: expected a number"),
        (msgpack.packb({"request_id": "r", "model": "m", "prompt_token_ids": [1], "deadline": "soon"}), "deadline"),
        (msgpack.packb({"request_id": "r", "model": "m", "prompt_token_ids": [1], "lane": "fast"}), "lane must be one of"),
        *[(msgpack.packb({"request_id": "r", "model": "m", "prompt_token_ids": [1], "token_subject": bad}),
           "token_subject must be a NATS subject") for bad in ("a b", "a\r\nPUB x", "a.*", "a.>", ">", "a..b", ".a",
                                                                 "a.", "x" * 257)],
        *[(msgpack.packb({"request_id": "r", "model": "m", "prompt_token_ids": [1], "token_subject": bad}),
           "token_subject must be llmbus.tok.r,") for bad in ("llmbus.abort.r", "llmbus.kvpool.release", "llmbus.tok",
                                                               "llmbus.tok.r.b", "llmbus.tok.other-request",
                                                               "llmbus.toks", "$JS.API.STREAM.DELETE.X",
                                                               "$JS.ACK.S.C.1.1.1.1.0")],
    ],
)
def test_malformed_generate_request_is_a_clear_protocol_error(payload, message):
    with pytest.raises(ProtocolError, match=message) as err:
        decode(GenerateRequest, payload)
    assert str(err.value).startswith("GenerateRequest")
    assert isinstance(err.value, ValueError)


def test_literal_token_subjects_are_accepted():
    for subject in ("llmbus.tok.r", "llmbus.toks.gw-1", "my_tool.events", "a*b.c>d", "x" * 256, "llmbusx.y",
                    "_INBOX.abc"):
        assert GenerateRequest("r", "m", [1], token_subject=subject).token_subject == subject


def test_error_texts_are_cut_short_however_much_they_quote():
    """Errors quote what was wrong with a message; however large that was, the error stays small
    enough to publish and to log, and says how much it left off."""
    from llmbus.protocol.messages import MAX_ERROR_CHARS

    for text in (TokenEvent.failure("r", "x" * 10_000).error, ErrorReply("y" * 10_000).error):
        assert len(text) < MAX_ERROR_CHARS + 40 and text.endswith("(9000 more characters)")
    assert ErrorReply("short").error == "short"
    payload = msgpack.packb({"request_id": "r", "model": "m", "prompt_token_ids": [1], "lane": "\x00" * 100_000})
    with pytest.raises(ProtocolError) as err:
        decode(GenerateRequest, payload)
    assert str(err.value).startswith("GenerateRequest: lane must be") and len(str(err.value)) < MAX_ERROR_CHARS + 40


def test_token_event_invariants():
    with pytest.raises(ProtocolError, match="finish_reason must be one of"):
        decode(TokenEvent, msgpack.packb({"request_id": "r", "seq": 0, "finish_reason": "done"}))
    with pytest.raises(ValueError, match="1 entries for 2 tokens"):
        TokenEvent("r", 0, [1, 2], [LogprobEntry(1, -1.0)])
    with pytest.raises(ProtocolError, match=r"logprobs\[0\].top\[0\]: expected a list of 2 items"):
        decode(TokenEvent, msgpack.packb({"request_id": "r", "seq": 0, "token_ids": [1],
                                          "logprobs": [{"token_id": 1, "logprob": -1.0, "top": [[1]]}]}))


STATE = {"request_id": "req-1", "prompt_token_ids": [5, 6, 7], "output_token_ids": [1]}  # a handoff's, trimmed


def test_handoff_checks_the_lease_matches_the_kv_shape():
    with pytest.raises(ValueError, match="kv_shape has 3 blocks but the lease has 2"):
        Handoff(_request(), [1], 3, LEASE, STATE, [3, 4, 64], "model")


def test_handoff_checks_a_block_fits_the_lease_blocks():
    with pytest.raises(ValueError, match="does not fit"):
        Handoff(_request(), [1], 3, LEASE, STATE, [2, 4, 1 << 20], "model")


def test_handoff_checks_its_seq_and_that_its_state_is_its_request_s():
    Handoff(_request(), [1], 3, LEASE, STATE, [2, 4, 64], "model", next_seq=1)
    for seq in (-1, 0, 2**31, 2**64 - 1):
        with pytest.raises(ValueError, match=r"next_seq must be in \[1, 2\*\*31\)"):
            Handoff(_request(), [1], 3, LEASE, STATE, [2, 4, 64], "model", next_seq=seq)
    with pytest.raises(ValueError, match="state is of request 'other', not 'req-1'"):
        Handoff(_request(), [1], 3, LEASE, STATE | {"request_id": "other"}, [2, 4, 64], "model")
    for state in (STATE | {"prompt_token_ids": [5, 6, 8]}, STATE | {"output_token_ids": [2]}, {"request_id": "req-1"}):
        with pytest.raises(ValueError, match="state's prompt and output tokens are not the request's"):
            Handoff(_request(), [1], 3, LEASE, state, [2, 4, 64], "model")


def test_encode_refuses_non_records():
    with pytest.raises(TypeError, match="protocol record"):
        encode({"request_id": "x"})


def test_sampling_spec_mirrors_sampling_params():
    spec_fields = {f.name: f.default for f in dataclasses.fields(SamplingSpec)}
    params_fields = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert set(spec_fields) == set(params_fields)
    for name, default in spec_fields.items():
        if default is not dataclasses.MISSING:
            assert default == params_fields[name], name
    spec = _request().sampling
    params = spec.to_params()
    assert params == SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=(2,), logprobs=2, seed=9)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingSpec(top_p=0.0).to_params()
    with pytest.raises(ValueError, match=r"stop_token_ids must be token ids >= 0, got \[2, -1\]"):
        SamplingSpec(stop_token_ids=[2, -1]).to_params()  # (a tool's, over the bus: the gateway checks its own)


# -- the codec's checks, one per kind of annotation, on records defined here ----------------------
@dataclasses.dataclass
class _Inner:
    name: str
    weight: float = 1.0


@dataclasses.dataclass
class _Every:
    count: int
    flag: bool
    blob: bytes
    either: int | str
    maybe: _Inner | None
    items: list[_Inner]
    loose: list[Any]
    pair: tuple[int, str]
    free: dict[str, int]
    late: int = 0


@dataclasses.dataclass
class _Unsupported:
    tags: set[int]


def _every_raw(**over):
    raw = {"count": 3, "flag": True, "blob": b"\x00\x01", "either": "x", "maybe": {"name": "a"},
           "items": [{"name": "b", "weight": 2}], "loose": [1, "two", None], "pair": [7, "seven"],
           "free": {"k": [1, 2]}, "extra": "ignored"}
    raw.update(over)
    return msgpack.packb(raw, use_bin_type=True)


def test_codec_reads_every_kind_of_field():
    got = decode(_Every, _every_raw())
    assert got == _Every(count=3, flag=True, blob=b"\x00\x01", either="x", maybe=_Inner("a"),
                         items=[_Inner("b", 2.0)], loose=[1, "two", None], pair=(7, "seven"),
                         free={"k": [1, 2]}, late=0)
    assert isinstance(got.items[0].weight, float)  # an integer on the wire becomes the float field
    assert decode(_Every, _every_raw(maybe=None, either=5)).maybe is None
    assert decode(_Every, encode(got)) == got  # tuples go out as lists and come back as tuples


@pytest.mark.parametrize("over,message", [
    ({"count": True}, r"_Every\.count: expected an integer, got bool"),
    ({"flag": 1}, r"_Every\.flag: expected a boolean, got int"),
    ({"blob": "text"}, r"_Every\.blob: expected bytes, got str"),
    ({"either": 1.5}, r"_Every\.either: no variant matched \(.*integer.*; .*string.*\)"),
    ({"either": None}, r"_Every\.either: must not be null"),
    ({"maybe": {"weight": 1.0}}, r"_Every\.maybe: missing required field 'name'"),
    ({"items": [{"name": "ok"}, {"name": 5}]}, r"_Every\.items\[1\]\.name: expected a string, got int"),
    ({"items": {"name": "b"}}, r"_Every\.items: expected a list, got dict"),
    ({"loose": "abc"}, r"_Every\.loose: expected a list, got str"),
    ({"pair": [7]}, r"_Every\.pair: expected a list of 2 items"),
    ({"pair": [7, 8]}, r"_Every\.pair\[1\]: expected a string, got int"),
    ({"free": [1]}, r"_Every\.free: expected a map, got list"),
    ({"late": "soon"}, r"_Every\.late: expected an integer, got str"),
])
def test_codec_names_the_field_that_is_wrong(over, message):
    with pytest.raises(ProtocolError, match=message):
        decode(_Every, _every_raw(**over))


def test_codec_rejects_a_record_with_an_annotation_it_cannot_check():
    with pytest.raises(TypeError, match="unsupported annotation"):
        decode(_Unsupported, msgpack.packb({"tags": [1]}))


@dataclasses.dataclass
class _IntFirst:
    x: int | float


@dataclasses.dataclass
class _FloatFirst:
    x: float | int


@dataclasses.dataclass
class _Malformed:
    a: int
    b: list[int, str] | None = None  # type: ignore[type-arg]  # a bug in a record definition


def test_codec_tries_union_variants_in_the_order_each_record_writes_them():
    # int | float == float | int in Python: a checker shared between the two would lose the order
    assert type(decode(_IntFirst, msgpack.packb({"x": 3})).x) is int
    assert type(decode(_FloatFirst, msgpack.packb({"x": 3})).x) is float


def test_codec_fails_on_a_malformed_annotation_only_where_its_field_is_sent():
    assert decode(_Malformed, msgpack.packb({"a": 1})) == _Malformed(a=1)
    with pytest.raises(ValueError):
        decode(_Malformed, msgpack.packb({"a": 1, "b": [1]}))
