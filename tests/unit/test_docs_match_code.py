"""The docs say what the code does: the defaults of `rpycdl serve`'s options (docs/servers.md), run_code's
arguments (docs/client-api.md) and what each extra installs (docs/getting-started.md), read from both; every
public name in the API reference, every parameter a public docstring names the function's; the README's and the
docs' links and paths lead somewhere."""

from __future__ import annotations

import inspect
import re

import docs_pages
import pytest
from docs_pages import DOCS, README, REPO

import rpycdl
from rpycdl import cli
from rpycdl.client import RemoteRoot
from rpycdl.errors import InvalidRequestError
from rpycdl.units import parse_size

SERVERS = (DOCS / "servers.md").read_text()
CLIENT_API = (DOCS / "client-api.md").read_text()
GETTING_STARTED = (DOCS / "getting-started.md").read_text()


def _serve_defaults() -> dict[str, object]:
    """`rpycdl serve`'s options and their defaults, from its parser."""
    commands = next(action for action in cli.parser()._actions if action.dest == "command")
    serve = commands.choices["serve"]
    return {option: action.default for action in serve._actions for option in action.option_strings}


def _same(readme: str, code: object) -> bool:
    """Whether the docs' default (their words) is the code's (a value)."""
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


ROWS = re.findall(r"^\| `(--[a-z-]+)[^|]*\| ([^|]+) \|", SERVERS, re.M)


@pytest.mark.parametrize(("option", "default"), ROWS, ids=[option for option, _ in ROWS])
def test_the_serve_options_table_gives_the_codes_defaults(option, default):
    defaults = _serve_defaults()
    assert option in defaults, f"docs/servers.md lists {option}, which rpycdl serve does not take"
    assert _same(default.strip(), defaults[option]), f"docs/servers.md: {option} defaults to {default.strip()}; " \
                                                     f"the code: {defaults[option]!r}"


def test_the_table_lists_every_serve_option():
    listed = {option for option, _ in ROWS} | set(re.findall(r"`(--tls-[a-z]+) FILE`", SERVERS))
    missing = {option for option in _serve_defaults() if option.startswith("--")} - listed - {"--help", "--verbose"}
    assert not missing, f"rpycdl serve options the table of docs/servers.md does not list: {sorted(missing)}"


def test_run_codes_signature_is_the_docs():
    said = re.search(r"`conn\.root\.run_code\((fn[^`]*)\)`", CLIENT_API.replace("\n  ", " ")).group(1)
    readme = {name.strip(): value for name, _, value in (part.partition("=") for part in said.split(","))
              if name.strip() not in ("fn", "*")}
    parameters = inspect.signature(RemoteRoot.run_code).parameters
    code = {name: repr(parameter.default) for name, parameter in parameters.items() if name not in ("self", "fn")}
    assert readme == code, f"docs/client-api.md: {readme}; code: {code}"


def _setup_lists() -> dict[str, list[str]]:
    """setup.py's CLIENT, SERVER and SITE requirements, by name (read, not run: it calls setup())."""
    import ast

    tree = ast.parse((REPO / "setup.py").read_text())
    lists = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            names = [re.split(r"[<>=;\[\s]", ast.literal_eval(item))[0] for item in node.value.elts]
            lists[node.targets[0].id] = [name for name in names if name != "tomli"]  # tomli: before Python 3.11 only
    return lists


@pytest.mark.parametrize(("extra", "install"), [("CLIENT", "is the client alone ("),
                                                ("SERVER", "'.[server]'` (adds "), ("SITE", "'.[site]'` (")])
def test_the_install_lines_name_what_setup_py_installs(extra, install):
    said = GETTING_STARTED.replace("\n", " ")
    listed = said[said.index(install) + len(install):].split(")")[0]
    assert sorted(name.strip() for name in listed.split(",")) == sorted(_setup_lists()[extra])


def test_the_api_reference_shows_every_public_name():
    reference = (DOCS / "api.md").read_text()
    shown = set(re.findall(r"^::: rpycdl\.(\w+)$", reference, re.M)) | set(re.findall(r"^ +- (\w+)$", reference, re.M))
    missing = set(rpycdl.__all__) - shown - {"__version__"}
    assert not missing, f"docs/api.md does not show {sorted(missing)}, which rpycdl exports"


def _documented() -> list[tuple[str, object]]:
    """Every public function and method of rpycdl's API, by name: what `rpycdl` exports, and conn.root's."""
    found = []
    for name, obj in [(name, getattr(rpycdl, name)) for name in rpycdl.__all__] + [("RemoteRoot", RemoteRoot)]:
        if inspect.isclass(obj):
            found += [(f"{name}.{member}", function) for member, function in vars(obj).items()
                      if inspect.isfunction(function) and not member.startswith("_")]
        elif inspect.isfunction(obj):
            found.append((name, obj))
    return found


def _named_arguments(doc: str) -> list[str]:
    """The parameters a Google-style docstring's Args section names ("fn, args: ..." names two)."""
    lines = inspect.cleandoc(doc).splitlines()
    if "Args:" not in lines:
        return []
    entries = []
    for line in lines[lines.index("Args:") + 1:]:
        if line.strip() and not line.startswith(" "):
            break  # Returns:, Raises:, ...
        entry = re.match(r"^    (\*{0,2}\w+(?:, \*{0,2}\w+)*)(?: \([^)]*\))?:", line)
        if entry:
            entries += [name.lstrip("*") for name in entry.group(1).split(", ")]
    return entries


@pytest.mark.parametrize(("name", "function"), _documented(), ids=[name for name, _ in _documented()])
def test_every_argument_a_docstring_names_is_the_functions(name, function):
    named = _named_arguments(function.__doc__ or "")
    parameters = set(inspect.signature(function).parameters)
    assert set(named) <= parameters, f"{name}'s docstring names {sorted(set(named) - parameters)}, which it does " \
                                     f"not take (it takes {sorted(parameters)})"


PAGES = [README, *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_a_pages_links_and_paths_lead_somewhere(page):
    """mkdocs build --strict checks the site's links (tests/test_docs.py); this checks the README's too, which
    the site does not build, and the repository's paths every page names in code spans."""
    for link in docs_pages.links(page):
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name} links to {link}: there is no {path.relative_to(REPO)}"
        if anchor and path.suffix == ".md":
            assert anchor in docs_pages.anchors(path), f"{page.name} links to {link}: no such heading there"
    missing = [path for path in docs_pages.repo_paths(page) if not (REPO / path).exists()]
    assert not missing, f"{page.name} names {missing}, which the repository does not hold"
