"""environment.yml and pyproject.toml name the same packages with the same pins."""

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def normalise(spec: str) -> str:
    return spec.split("#")[0].replace(" ", "").lower().replace("_", "-")


def test_environment_yml_agrees_with_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    from_pyproject = {normalise(s) for s in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        from_pyproject |= {normalise(s) for s in extra}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_lists = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    from_env = {normalise(s) for s in pip_lists[0]}
    assert from_env == from_pyproject, (
        f"only in environment.yml: {sorted(from_env - from_pyproject)}; "
        f"only in pyproject.toml: {sorted(from_pyproject - from_env)}"
    )


def test_pins_that_break_are_pinned():
    deps = {normalise(s) for s in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert "numpy>=2.0,<2.5" in deps
    assert "numba-cuda[cu13]>=0.30,<0.31" in deps
    assert "jupyter-book>=1.0,<2" in deps
