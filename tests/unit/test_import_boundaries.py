"""No service imports another: what two services share is a package of its own in libra/
(docs/architecture.md; libra/weights/ for the trainer → rollout weight transport)."""

from __future__ import annotations

import ast
import pathlib

SERVICES = pathlib.Path(__file__).resolve().parents[2] / "services"


def crossings(source: str, service: str, package: str) -> list[str]:
    """The modules of other services that `source` (a module of `package`, in `service`) imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[:len(package.split(".")) + 1 - node.level]) if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            found += [f"{module}.{alias.name}" for alias in node.names]
    return [name for name in found if name.startswith("libra.services.") and name.split(".")[2] != service]


def test_no_service_imports_another():
    assert crossings("from libra.services.trainer import loop", "rollout", "libra.services.rollout")  # it can fail
    assert crossings("from ... import trainer", "rollout", "libra.services.rollout.engines")
    found = []
    for path in sorted(SERVICES.rglob("*.py")):
        parts = path.relative_to(SERVICES).with_suffix("").parts
        package = ".".join(["libra.services", *parts[:-1]])
        found += [f"{path.relative_to(SERVICES.parent)}: {name}"
                  for name in crossings(path.read_text(), parts[0], package)] if len(parts) > 1 else []
    assert not found, "a service imports another (move what they share into libra/):\n" + "\n".join(found)
