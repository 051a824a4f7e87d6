"""The README says what the code does: the defaults of `rpycdl serve`'s options and of run_code's
arguments, read from both."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from rpycdl import cli
from rpycdl.client import RemoteRoot
from rpycdl.errors import InvalidRequestError
from rpycdl.units import parse_size

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _serve_defaults() -> dict[str, object]:
    """`rpycdl serve`'s options and their defaults, from its parser."""
    commands = next(action for action in cli.parser()._actions if action.dest == "command")
    serve = commands.choices["serve"]
    return {option: action.default for action in serve._actions for option in action.option_strings}


def _same(readme: str, code: object) -> bool:
    """Whether the README's default (its words) is the code's (a value)."""
    if readme == "off":
        return code is False
    if readme in ("none", "required", "from package metadata") or readme.startswith("none:"):  # decided at run time
        return code is None
    text = readme.split(",")[0].strip("` ")  # "`$RPYCDL_GPUS`, else `nvml`": the code's default is None
    if text.startswith("$"):
        return code is None
    try:
        return parse_size(text) == parse_size(str(code))
    except InvalidRequestError:
        return text == str(code)


ROWS = re.findall(r"^\| `(--[a-z-]+)[^|]*\| ([^|]+) \|", README, re.M)


@pytest.mark.parametrize(("option", "default"), ROWS, ids=[option for option, _ in ROWS])
def test_the_serve_options_table_gives_the_codes_defaults(option, default):
    defaults = _serve_defaults()
    assert option in defaults, f"the README lists {option}, which rpycdl serve does not take"
    assert _same(default.strip(), defaults[option]), f"README: {option} defaults to {default.strip()}; " \
                                                     f"the code: {defaults[option]!r}"


def test_the_table_lists_every_serve_option():
    listed = {option for option, _ in ROWS} | set(re.findall(r"`(--tls-[a-z]+) FILE`", README))
    missing = {option for option in _serve_defaults() if option.startswith("--")} - listed - {"--help", "--verbose"}
    assert not missing, f"rpycdl serve options the README's table does not list: {sorted(missing)}"


def test_run_codes_signature_is_the_readmes():
    said = re.search(r"`conn\.root\.run_code\((fn[^`]*)\)`", README.replace("\n  ", " ")).group(1)
    readme = {name.strip(): value for name, _, value in (part.partition("=") for part in said.split(","))
              if name.strip() not in ("fn", "*")}
    parameters = inspect.signature(RemoteRoot.run_code).parameters
    code = {name: repr(parameter.default) for name, parameter in parameters.items() if name not in ("self", "fn")}
    assert readme == code, f"README: {readme}; code: {code}"


def _setup_lists() -> dict[str, list[str]]:
    """setup.py's CLIENT, SERVER and SITE requirements, by name (read, not run: it calls setup())."""
    import ast

    tree = ast.parse((Path(__file__).resolve().parents[2] / "setup.py").read_text())
    lists = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            names = [re.split(r"[<>=;\[\s]", ast.literal_eval(item))[0] for item in node.value.elts]
            lists[node.targets[0].id] = [name for name in names if name != "tomli"]  # tomli: before Python 3.11 only
    return lists


@pytest.mark.parametrize(("extra", "install"), [("CLIENT", "is the client alone ("),
                                                ("SERVER", "'.[server]'` (adds "), ("SITE", "'.[site]'` (")])
def test_the_install_lines_name_what_setup_py_installs(extra, install):
    said = README.replace("\n", " ")
    listed = said[said.index(install) + len(install):].split(")")[0]
    assert sorted(name.strip() for name in listed.split(",")) == sorted(_setup_lists()[extra])
