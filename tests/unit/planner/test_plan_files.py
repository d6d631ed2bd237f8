"""Plan and profile files are untrusted input: their readers raise ValueError, never anything else.

Every rank reads the plan at ``zensync.register`` (issue 11, items 3 and 4), so a bad file must stop
there with one clear ``ValueError``: not a ``RecursionError`` from deep nesting, an ``OverflowError``
from a huge number, a ``KeyError``/``TypeError`` from a missing or mistyped field, nor a plan that
loads and then fails at the first backward (``topk:-0.5``). The oracle is exact: a reader either
raises ``ValueError`` or returns an object that writes back to the same text.

Valid files come from the planner itself (resnet50 on 2 x 4 GPUs, top-k with a measured cost), and
Hypothesis mutates them: random JSON at random places, deleted and added fields, edits of the raw text.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import examples
from zensync import cli
from zensync.compress import COMPRESSED_SCHEMES
from zensync.cost import measured_compressor_model
from zensync.hooks.strategy import resolve_strategy
from zensync.planner import (
    MAX_JSON_CHARS,
    MAX_JSON_DEPTH,
    MAX_TENSORS,
    ClusterSpec,
    ModelProfile,
    Plan,
    builtin_profile,
    plan,
)
from zensync.planner.plan import _RUNTIME_SCHEME

MEASURED = {"gpu_compress": {"fixed_s": 2e-05, "per_element_s": 1e-10, "knee_elements": 4096}}
"""A measured cost as ``zensync profile`` writes it (``knee_elements`` an int, kept an int on reload)."""


@functools.cache
def _valid_plan() -> Plan:
    profile = builtin_profile("resnet50")
    cluster = ClusterSpec.from_strings(nodes=2, gpus_per_node=4, inter="10Gbit")
    chosen = plan(profile, cluster, measured_compressor_model("topk:0.01", MEASURED), cpu_offload=True, two_level=True)
    return dataclasses.replace(chosen, profile=profile, costs=MEASURED)


def _plan_text() -> str:
    return _valid_plan().to_json()


def _profile_text() -> str:
    profile = _valid_plan().profile
    assert profile is not None
    return profile.to_json()


def _load(reader: Callable[[str], Any], text: str) -> Any:
    """``reader(text)``, or None when it raises ValueError; any other exception fails the test."""
    try:
        return reader(text)
    except ValueError:
        return None


def _edited(edit: Callable[[dict[str, Any]], object]) -> str:
    data = json.loads(_plan_text())
    edit(data)
    return json.dumps(data)


def _comp_tensor(data: dict[str, Any]) -> dict[str, Any]:
    return next(t for t in data["tensors"] if t["option"].startswith("comp-"))


# -- valid files ------------------------------------------------------------------------------------------------------


def test_valid_files_round_trip_exactly() -> None:
    text = _plan_text()
    assert any(t.option.kind == "comp" for t in _valid_plan().tensors)
    assert Plan.from_json(text) == _valid_plan()
    assert Plan.from_json(text).to_json() == text  # knee_elements stays 4096, not 4096.0
    assert ModelProfile.from_json(_profile_text()).to_json() == _profile_text()


def test_runtime_scheme_names_are_the_sync_layer_ones() -> None:
    assert set(_RUNTIME_SCHEME.values()) <= set(COMPRESSED_SCHEMES)


# -- caps: nesting, size, counts --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,
        '{"a":' * 100_000,
        "[" * 100_000 + "]" * 100_000,
        '{"version": 1, "tensors": ' + "[" * 100_000,
        '{"version": 1, "model": "m", "costs": ' + '{"x": ' * 50_000,
    ],
    ids=["open-arrays", "open-objects", "closed-arrays", "plan-prefix", "in-costs"],
)
@pytest.mark.parametrize("reader", [Plan.from_json, ModelProfile.from_json], ids=["plan", "profile"])
def test_deep_nesting_is_a_value_error(reader: Callable[[str], Any], text: str) -> None:
    """Before the fix: RecursionError ("maximum recursion depth exceeded while decoding a JSON array")."""
    with pytest.raises(ValueError, match=r"nests arrays/objects at least \d+ deep, above MAX_JSON_DEPTH=32"):
        reader(text)


def test_nesting_up_to_the_bound_reaches_the_field_checks() -> None:
    deep = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
    with pytest.raises(ValueError, match=r"plan must be a JSON object, got list"):
        Plan.from_json(deep)
    with pytest.raises(ValueError, match=r"nests .* deep"):
        Plan.from_json(f"[{deep}, [{deep}]]")
    brackets_in_strings = json.dumps({"version": 1, "model": "[" * 1000})
    with pytest.raises(ValueError, match=r"missing field"):
        Plan.from_json(brackets_in_strings)


def test_oversized_text_is_refused_before_parsing() -> None:
    """Before the fix: the 64 MiB text was parsed (and the message said nothing of a size)."""
    text = "{}" + " " * MAX_JSON_CHARS
    for reader in (Plan.from_json, ModelProfile.from_json):
        with pytest.raises(ValueError, match=r"more than MAX_JSON_CHARS=67,108,864"):
            reader(text)


def test_too_many_tensors() -> None:
    text = _edited(lambda d: d.update(tensors=[0] * (MAX_TENSORS + 1)))
    with pytest.raises(ValueError, match=r"'tensors'=.*must have at most 100,000 items \(more tensors than any"):
        Plan.from_json(text)
    profile = json.loads(_profile_text())
    profile["tensors"] = [0] * (MAX_TENSORS + 1)
    with pytest.raises(ValueError, match=r"profile field 'tensors'=.*at most 100,000 items"):
        ModelProfile.from_json(json.dumps(profile))


# -- compressor specs and options: checked at load (register), not at the first backward ----------------------------


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("topk:-0.5", "ratio=-0.5 must be in (0, 1]"),
        ("topk:2", "ratio=2.0 must be in (0, 1]"),
        ("topkk:0.1", "unknown compressor 'topkk'"),
        ("dgc", "missing 1 required positional argument"),
        ("powersgd:4", "cannot be planned"),
    ],
)
def test_bad_compressor_spec_fails_at_load(spec: str, reason: str) -> None:
    """Before the fix: ``topk:-0.5`` loaded, and the first backward raised."""
    text = _edited(lambda d: d.update(compressor=spec))
    first = next(t.name for t in _valid_plan().tensors if t.option.kind == "comp")
    with pytest.raises(ValueError, match=r"plan field 'compressor'=") as info:
        Plan.from_json(text)
    message = str(info.value)
    assert repr(spec) in message and f"tensor {first!r}" in message and reason in message


def test_register_rejects_a_bad_spec_in_a_plan(tmp_path: Any) -> None:
    """``zensync.register(ddp, strategy=path)`` resolves the strategy on every rank before any step."""
    path = tmp_path / "plan.json"
    path.write_text(_edited(lambda d: d.update(compressor="topk:-0.5")))
    with pytest.raises(ValueError, match=r"'topk:-0.5' \(tensor '.*' and \d+ other\(s\) use it\) is invalid: ratio"):
        resolve_strategy(str(path))


@pytest.mark.parametrize(
    ("option", "nodes", "message"),
    [
        ("comp-ar-gpu-flat", 2, "allreduce-compatible: False"),  # top-k payloads cannot be summed
        ("comp-ag-gpu-hier", 1, "on 1 node(s) x 4 GPU(s)"),  # two-level needs several nodes
    ],
)
def test_option_the_compressor_cannot_run_fails_at_load(option: str, nodes: int, message: str) -> None:
    """Before the fix: both loaded; the allreduce one raised in CompressedSync at the first backward."""

    def edit(data: dict[str, Any]) -> None:
        _comp_tensor(data)["option"] = option
        data["cluster"]["nodes"] = nodes

    data = json.loads(_edited(edit))
    with pytest.raises(ValueError, match=rf"plan tensor '{_comp_tensor(data)['name']}' \(tensors\[\d+\]\)") as info:
        Plan.from_json(json.dumps(data))
    assert f"option {option!r} is not offered for compressor 'topk:0.01'" in str(info.value)
    assert message in str(info.value)


# -- fields: each message names the field, the value, the bound and why ----------------------------------------------


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    """An edit that sets ``path`` (dotted, ``tensors.0.numel``) to ``value``."""

    def edit(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value

    return edit


FIELD_CASES = [
    # (edit or raw text, expected message fragment); before the fix each loaded, or raised a non-ValueError.
    (_set("tensors.0.numel", 2.5), "plan field 'tensors[0].numel'=2.5: must be an integer in [0, "),
    (_set("tensors.0.numel", True), "plan field 'tensors[0].numel'=True: must be an integer"),
    (_set("tensors.0.numel", 10**30), "(far more elements than any real parameter has; MAX_NUMEL)"),
    (_set("tensors.0.group", False), "plan field 'tensors[0].group'=False"),
    (_set("tensors.0.name", 7), "plan field 'tensors[0].name'=7: must be a string of 1 to 4,096"),
    (
        _set("tensors.0.option", "comp-" * 100),
        "'tensors[0].option'='comp-comp-comp-comp-comp-co...mp-comp-comp-comp-comp-comp-': must be an option code",
    ),
    (_set("tensors.0.extra", 1), "plan has unknown field(s) ['tensors[0].extra']"),
    (_set("tensors.3", "x"), "plan field 'tensors[3]' must be a JSON object, got str 'x'"),
    (_set("predicted_s.plan", 10**400), "plan holds an integer of 401 digits, more than 100"),
    (_set("predicted_s.fp32", "fast"), "must be a finite number >= 0 (seconds per iteration)"),
    (_set("selection_s", -1), "plan field 'selection_s'=-1: must be a finite number >= 0"),
    (_set("cluster.nodes", 10**30), "must be an int >= 1 and <= 1,048,576 (MAX_WORLD_SIZE)"),
    (_set("cluster.nodes", 2**19), "= 2,097,152 ranks, more than MAX_WORLD_SIZE=1,048,576"),
    (_set("cluster.intra_latency_s", -1), "plan field 'cluster': ClusterSpec.intra_latency_s=-1 must be a finite"),
    (_set("cluster.intra_latency_s", True), "ClusterSpec.intra_latency_s=True must be a finite number"),
    (_set("chosen", "best"), "plan field 'chosen'='best': must be one of ('search', 'fp32', 'fp16')"),
    (_set("flags.turbo", True), "plan has unknown field(s) ['flags.turbo']"),
    (_set("costs.gpu_compress.knee_elements", 1.5), "'costs.gpu_compress.knee_elements'=1.5: must be an integer"),
    (_set("costs.gpu_compress.fixed_s", -1e-5), "'costs.gpu_compress.fixed_s'=-1e-05: must be a finite number"),
    (_set("costs.wire", {}), "plan has unknown field(s) ['costs.wire']"),
    (_set("costs.gpu_compress", [1]), "plan field 'costs.gpu_compress' must be a JSON object, got list [1]"),
    (_set("profile.tensors.0.shape", [2.5]), "plan field 'profile.tensors[0].shape[0]'=2.5: must be an integer"),
    (_set("profile.tensors.0.shape", [-1]), "'profile.tensors[0].shape[0]'=-1: must be an integer in [0, "),
    (_set("profile.tensors.0.shape", [2**40, 2**40]), "holds more than 1,125,899,906,842,624 elements"),
    (_set("profile.tensors.0.shape", [1] * 65), "must have at most 64 items (parameters have 1 to 5 dimensions"),
    (_set("profile.tensors.0.ready_s", "soon"), "'profile.tensors[0].ready_s'='soon': must be a finite number"),
    (_set("profile.tensors.0.name", "fc.renamed"), "'profile.tensors[0]' is 'fc.renamed'"),
    (_set("profile.dtype_bytes", 3), "plan field 'profile': profile 'resnet50': dtype_bytes=3 must be 2, 4 or 8"),
    (_set("profile.version", 2), "plan field 'profile': profile version 2 is not 1"),
    (_set("profile.model", None), "plan field 'profile.model'=None: must be a string"),
    (_set("profile.tensors", []), "plan field 'profile': profile 'resnet50' has no tensors"),
    (_set("model", "m" * 10_000), "plan field 'model'='mmmmmmmm"),
    (_set("version", True), "plan version True is not supported"),
    (_set("version", 1.0), "plan version 1.0 is not supported"),
    (lambda d: d.pop("compressor"), "plan is missing field(s) ['compressor']"),
    (lambda d: d.update(surprise=1), "plan has unknown field(s) ['surprise'] (a typo or a newer format?)"),
    (
        lambda d: d["tensors"].append(d["tensors"][0]),
        "tensor names must be non-empty and unique ('fc.bias' appears 2 times)",
    ),
    ('{"version": 1, "version": 1}', "plan repeats the key 'version' in one object"),
    ('{"version": 1, "selection_s": NaN}', "plan holds NaN, which is not JSON (RFC 8259)"),
    ('{"version": 1, "selection_s": 1e999}', "plan holds the number '1e999', which overflows a float64"),
    ('{"version": 1, "selection_s": -Infinity}', "plan holds -Infinity"),
    ("1" * 5000, "plan holds an integer of 5,000 digits, more than 100"),
]


@pytest.mark.parametrize(("edit", "message"), FIELD_CASES, ids=[m[:48] for _, m in FIELD_CASES])
def test_bad_fields_name_field_value_bound_and_why(edit: Any, message: str) -> None:
    text = edit if isinstance(edit, str) else _edited(edit)
    with pytest.raises(ValueError) as info:
        Plan.from_json(text)
    assert message in str(info.value)
    assert len(str(info.value)) < 800  # values are shortened, however large


def test_cluster_spec_refuses_numbers_beyond_float64() -> None:
    """Before the fix: OverflowError from math.isfinite (the plan reader now stops such integers earlier)."""
    fields = _valid_plan().cluster.to_dict()
    for name in ("inter_bandwidth_bytes_per_s", "inter_latency_s"):
        with pytest.raises(ValueError, match=rf"ClusterSpec.{name}=1000[0.]* must be a"):
            ClusterSpec.from_dict({**fields, name: 10**400})


def test_values_in_messages_are_shortened() -> None:
    with pytest.raises(ValueError) as info:
        Plan.from_json(_edited(_set("model", list(range(100_000)))))
    assert "plan field 'model'=[0, 1, 2, 3, 4, 5, ...]: must be a string" in str(info.value)


def test_non_text_input() -> None:
    with pytest.raises(ValueError, match="plan must be JSON text \\(str\\), got NoneType"):
        Plan.from_json(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="profile must be JSON text \\(str\\), got bytes"):
        ModelProfile.from_json(b"{}")  # type: ignore[arg-type]


def test_explain_reports_a_deep_plan_in_one_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    path.write_text("[" * 100_000)
    assert cli.main(["explain", str(path)]) != 0  # the CLI's own tests pin the status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MAX_JSON_DEPTH=32" in err


# -- fuzzing: random JSON, random edits of valid files ----------------------------------------------------------------

_EXTREME_VALUES = (0, -1, 2.5, -0.0, 2**50 + 1, 2**53 + 1, 10**30, 10**400, 1e308, math.inf, math.nan, True)
"""Values at or past the bounds (NaN and infinities included: json.dumps writes them, the readers refuse them)."""
_EXTREMES = st.sampled_from(_EXTREME_VALUES)
_NUMBERS = st.one_of(st.integers(), st.floats(), _EXTREMES)
_JSON = st.recursive(
    st.none() | _NUMBERS | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
_TEXT_EDITS = st.text(alphabet='[]{}",:0123456789.eE-+ tfnaulrsNI\\', min_size=0, max_size=4)


def _slots(node: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key or index) in the tree, parents before children."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        out.append((node, key))
        _slots(child, out)
    return out


_ACTIONS = ("replace", "extreme", "extreme", "extreme", "delete", "add", "wrap", "stringify", "duplicate")
"""Edits of one slot; a number past its bounds is the likeliest to slip through, so it is drawn most."""


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@st.composite
def _mutated(draw: st.DrawFn, text: str) -> str:
    data = json.loads(text)
    pick = random.Random(draw(st.integers(0, 2**32 - 1)))  # uniform over slots (st.sampled_from favours the first)
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(data, [])
        action = draw(st.sampled_from(_ACTIONS))
        if action == "extreme":  # a number (size, time, count) replaced by one at or past its bounds
            slots = [(node, key) for node, key in slots if _is_number(node[key])] or slots
        if not slots:
            break
        node, key = pick.choice(slots)
        if action == "replace":
            node[key] = draw(_JSON)
        elif action == "extreme":
            node[key] = pick.choice(_EXTREME_VALUES)  # uniform (st.sampled_from favours the first)
        elif action == "delete":
            del node[key]
        elif action == "add":
            if isinstance(node, dict):
                node[draw(st.text(max_size=6))] = draw(_JSON)
            else:
                node.insert(key, draw(_JSON))
        elif action == "wrap":
            node[key] = [node[key]] if draw(st.booleans()) else {"x": node[key]}
        elif action == "stringify":
            node[key] = json.dumps(node[key])
        elif isinstance(node, list):
            node.insert(key, node[key])
    return json.dumps(data)


@st.composite
def _text_edited(draw: st.DrawFn, text: str) -> str:
    pick = random.Random(draw(st.integers(0, 2**32 - 1)))
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):  # anywhere: a few characters
            start = pick.randrange(len(text) + 1)
            end = min(len(text), start + draw(st.integers(0, 8)))
            text = text[:start] + draw(_TEXT_EDITS) + text[end:]
        else:  # where a value starts (so the text parses up to it): nested arrays, up to far past the bound
            start = pick.choice([i + 2 for i in range(len(text)) if text.startswith(": ", i)])
            text = text[:start] + "[" * draw(st.integers(1, 5000)) + text[start:]
    if draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]  # truncated, as by a full disk
    return text


def _check_reader(reader: Callable[[str], Any], text: str) -> None:
    """ValueError, or an object that writes back to text that loads as the same object."""
    loaded = _load(reader, text)
    if loaded is not None:
        assert reader(loaded.to_json()) == loaded


@settings(max_examples=examples(150))
@given(value=_JSON, depth=st.just(0) | st.integers(0, 5000))
def test_random_json_only_raises_value_error(value: Any, depth: int) -> None:
    versioned = json.dumps({"version": 1, **value} if isinstance(value, dict) else value)
    for text in (json.dumps(value), versioned, "[" * depth + versioned + "]" * depth):
        _check_reader(Plan.from_json, text)
        _check_reader(ModelProfile.from_json, text)


@settings(max_examples=examples(150))
@given(data=st.data())
def test_mutated_plans_only_raise_value_error(data: st.DataObject) -> None:
    _check_reader(Plan.from_json, data.draw(_mutated(_plan_text())))


@settings(max_examples=examples(150))
@given(data=st.data())
def test_mutated_profiles_only_raise_value_error(data: st.DataObject) -> None:
    _check_reader(ModelProfile.from_json, data.draw(_mutated(_profile_text())))


@settings(max_examples=examples(100))
@given(data=st.data())
def test_edited_plan_text_only_raises_value_error(data: st.DataObject) -> None:
    _check_reader(Plan.from_json, data.draw(_text_edited(_plan_text())))


@settings(max_examples=examples(50))
@given(depth=st.integers(0, 3 * MAX_JSON_DEPTH), opener=st.sampled_from(["[", '{"k": ', '{"k": [']))
def test_nesting_around_a_valid_plan(depth: int, opener: str) -> None:
    closer = {"[": "]", '{"k": ': "}", '{"k": [': "]}"}[opener]
    text = opener * depth + _plan_text() + closer * depth
    if depth == 0:
        assert Plan.from_json(text) == _valid_plan()
        return
    with pytest.raises(ValueError) as info:  # a list, or an object without the plan's fields
        Plan.from_json(text)
    levels = depth * len(closer) + 5  # the plan itself nests 5 deep (plan > profile > tensors > tensor > shape)
    assert ("MAX_JSON_DEPTH" in str(info.value)) == (levels > MAX_JSON_DEPTH)


def test_huge_plan_file_is_refused_before_reading(tmp_path) -> None:
    from zensync.planner import MAX_JSON_CHARS

    path = tmp_path / "huge.json"
    with open(path, "wb") as f:
        f.truncate(MAX_JSON_CHARS + 1)  # sparse: no disk used, and never read
    with pytest.raises(ValueError, match="MAX_JSON_CHARS"):
        resolve_strategy(str(path))
