"""The names the docs cite exist in the code: modules, their functions and classes, message
fields, counters, configuration keys and the protocol's version. A rename that leaves a doc
behind fails here, naming the doc and the name."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import kvxferd
from kvxferd import protocol as P
from kvxferd.config import Config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
CODE = re.compile(r"`([^`\n]+)`")
MODULES = {m.name.removeprefix("kvxferd.") for m in pkgutil.walk_packages(kvxferd.__path__, "kvxferd.")}
UPSTREAM = {"toy_proxy_server.py"}  # vLLM's example proxy, which docs compare `kvxferd proxy` with
# what a doc's `message.field` names: the struct that has the field
FIELDS = {"registered": P.Registered, "remote": P.RemoteRef, "hold": P.Hold, "read": P.Read,
          "counters": P.Counters, "status": P.Status}


def _cited(doc: Path) -> list[str]:
    return CODE.findall(doc.read_text())


def _resolves(dotted: str) -> bool:
    """`module.attr[.attr]` (`kvxferd.` optional): the module imports and has the attributes."""
    parts = dotted.removeprefix("kvxferd.").removesuffix("()").split(".")
    if ".".join(parts) in MODULES:
        return True
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        if module in MODULES:
            try:
                obj: object = importlib.import_module(f"kvxferd.{module}")
                for attr in parts[cut:]:
                    if not hasattr(obj, attr) and attr not in getattr(obj, "__struct_fields__", ()):
                        return False
                    obj = getattr(obj, attr, None)
            except ModuleNotFoundError as exc:  # the connector's modules need vLLM (its own suite)
                if exc.name == "vllm" or (exc.name or "").startswith("vllm."):
                    return True
                raise
            return True
    return True  # not a kvxferd module (the standard library, a field path): not this test's


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_cited_files_modules_and_functions_exist(doc):
    missing = []
    for name in _cited(doc):
        name = name.split("::")[0].strip()
        if re.fullmatch(r"[\w/]+\.py", name):
            if name in UPSTREAM or name.startswith(("vllm/v1/", "vllm/platforms/", "vllm/distributed/")):
                continue  # vLLM's own sources, cited to compare
            path = name.removeprefix("kvxferd/")
            if not any((base / path).exists() for base in (ROOT / "kvxferd", ROOT / "tests", ROOT)):
                missing.append(name)
        elif re.fullmatch(r"[a-z][a-z]*(\.[a-z][A-Za-z]*)+", name) and re.search(r"\.[a-z]+[A-Z]", name):
            if not _in_chart_values(name):  # a chart value (camelCase): values.yaml has it
                missing.append(name)
        elif re.fullmatch(r"[a-z_][\w.]*\.\w+(\(\))?", name) and not _resolves(name):
            missing.append(name)
    assert not missing, f"{doc.name} cites names the code does not have: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_cited_message_fields_exist(doc):
    missing = []
    for name in _cited(doc):
        m = re.fullmatch(r"(\w+)\.(\w+)", name)
        if m and m.group(1) in FIELDS and m.group(2) not in FIELDS[m.group(1)].__struct_fields__:
            missing.append(name)
    assert not missing, f"{doc.name} cites message fields that do not exist: {missing}"


def _in_chart_values(dotted: str) -> bool:
    import yaml

    node: object = yaml.safe_load((ROOT / "helm" / "kvxferd" / "values.yaml").read_text())
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


@pytest.mark.parametrize("doc", ["deploy.md", "security.md", "reliability.md", "architecture.md", "protocol.md",
                                 "vllm.md"])
def test_configuration_keys_set_in_the_docs_exist(doc):
    """`key = value` in a doc names a key of the daemon's configuration or the vLLM connector's."""
    from kvxferd.vllm.options import ConnectorOptions

    keys = set(Config.__struct_fields__) | set(ConnectorOptions.__struct_fields__)
    named = {m.group(1) for name in _cited(ROOT / "docs" / doc) if (m := re.fullmatch(r"([a-z][a-z0-9_]*) = .+", name))}
    assert named <= keys, f"{doc} sets configuration keys that do not exist: {sorted(named - keys)}"


def test_the_protocol_version_the_docs_give_is_the_code_s():
    v = P.PROTOCOL_VERSION
    protocol = (ROOT / "docs" / "protocol.md").read_text()
    assert f"protocol version {v}\n" in protocol
    assert f"`version` ({v}; 1 to {v - 1} are still served)" in protocol
    assert f"protocol (version {v})" in (ROOT / "README.md").read_text()
    assert tuple(range(1, v + 1)) == P.SUPPORTED_VERSIONS


def test_configuration_keys_in_the_shipped_toml_exist():
    import tomllib

    from kvxferd.config import load

    cfg = tomllib.loads((ROOT / "deploy" / "kvxferd.toml").read_text())
    assert set(cfg) <= set(Config.__struct_fields__)
    assert load(str(ROOT / "deploy" / "kvxferd.toml"), env={}).side_channel_port == cfg["side_channel_port"]
