"""Plan specs: ``@DIR/plan.json`` works where a spec is taken (the CLI too), and a plan that would be read
two ways (a weight given twice, widths that disagree with the spec, a plan naming a plan) is refused."""

from __future__ import annotations

import json

import pytest

from interp.errors import SpecError
from interp.quant.spec import MethodSpec, parse_spec

PLAN_SPEC = "rtn:bits=3,group=64,zero=float|0.v=4|1.down=4"


def write_plan(folder, spec=PLAN_SPEC, widths=None):
    record = {"spec": spec}
    if widths is not None:
        record["widths"] = widths
    path = folder / "plan.json"
    path.write_text(json.dumps(record))
    return path


def all_widths(spec: str, n_layers: int = 2) -> dict[str, int]:
    parsed = parse_spec(spec)
    return {f"{layer}.{role}": parsed.bits_for(layer, role)
            for layer in range(n_layers) for role in ("q", "k", "v", "o", "gate", "up", "down")}


def test_a_plan_file_parses_to_its_spec(tmp_path):
    path = write_plan(tmp_path, widths=all_widths(PLAN_SPEC))
    assert parse_spec(f"@{path}") == parse_spec(PLAN_SPEC)
    assert str(parse_spec(f"@{path}")) == PLAN_SPEC


@pytest.mark.parametrize("spec", ["rtn:bits=3|0.v=4|00.v=2", "rtn:bits=3|1.down=4|01.down=4"])
def test_one_weight_given_twice_is_refused(spec):
    with pytest.raises(SpecError, match="given twice"):
        parse_spec(spec)


def test_one_weight_given_twice_in_a_module_map_is_refused():
    with pytest.raises(SpecError, match="given twice"):
        MethodSpec("rtn", 3, modules={"0.v": 4, "00.v": 2})


def test_a_plan_naming_itself_is_a_clear_error_not_a_recursion(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"spec": f"@{path}"}))
    with pytest.raises(SpecError, match="names another plan file"):
        parse_spec(f"@{path}")


def test_a_plan_naming_another_plan_is_refused(tmp_path):
    inner = write_plan(tmp_path)
    outer = tmp_path / "outer.json"
    outer.write_text(json.dumps({"spec": f"@{inner}"}))
    with pytest.raises(SpecError, match="names another plan file"):
        parse_spec(f"@{outer}")


def test_widths_edited_without_the_spec_are_refused(tmp_path):
    widths = all_widths(PLAN_SPEC)
    widths["1.q"] = 4  # a hand edit the spec does not carry: before, it was silently ignored
    path = write_plan(tmp_path, widths=widths)
    with pytest.raises(SpecError, match="disagree on '1.q'"):
        parse_spec(f"@{path}")


def test_the_cli_takes_a_plan_file_as_the_method(tmp_path, monkeypatch, capsys):
    """docs/prescribe.md: ``interp quantize --model M --method @DIR/plan.json --out DIR``."""
    from test_cli_hostile import intercept_work, run_cli

    intercept_work(monkeypatch)
    path = write_plan(tmp_path, widths=all_widths(PLAN_SPEC))
    outcome = run_cli(["quantize", "--model", "smollm2-135m", "--method", f"@{path}", "--out",
                       str(tmp_path / "planned")], capsys)
    assert outcome.kind == "work", outcome  # every check passed; the model load was next
    bad = write_plan(tmp_path, spec=f"@{path}")
    outcome = run_cli(["quantize", "--model", "smollm2-135m", "--method", f"@{bad}", "--out",
                       str(tmp_path / "planned2")], capsys)
    assert (outcome.kind, outcome.code) == ("exit", 2) and "names another plan file" in outcome.err, outcome
