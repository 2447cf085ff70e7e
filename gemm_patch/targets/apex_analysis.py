"""What megatron-core's layers module relies on from apex's ``fused_weight_gradient_mlp_cuda``,
read from its source: the guarded import that sets the availability flag, the constructor
checks that read the flag, and the wgrad calls into the extension.

The stand-in is only safe where these look the way they did in a verified release, so their
AST (and nothing else of the 1,500-line module) is what the fingerprint covers.
"""

from __future__ import annotations

import ast
import types
from dataclasses import dataclass

from ..engine.callsite import fingerprint, read_module


@dataclass(frozen=True)
class ApexUsage:
    guarded_import: ast.Try | None = None
    flag_default: ast.Assign | None = None
    checks: tuple[ast.expr, ...] = ()
    calls: tuple[ast.Call, ...] = ()
    # Whether the module names the extension at all (an import, a name, an attribute base).
    mentions: bool = False

    @property
    def call_names(self) -> list[str]:
        return sorted({c.func.attr for c in self.calls})  # type: ignore[attr-defined]

    @property
    def fingerprint(self) -> str | None:
        """The call-site targets' digest (independent of formatting and of the Python version);
        None where the module neither names the extension nor has the flag: no apex usage."""
        if not (self.mentions or self.flag_default or self.checks):
            return None
        return fingerprint(self.flag_default, self.guarded_import, *self.checks, *self.calls)


def _imports(node: ast.stmt, extension: str) -> bool:
    return isinstance(node, ast.Import) and any(a.name == extension and a.asname is None for a in node.names)


def _assigns(node: ast.stmt, flag: str, value: bool) -> bool:
    return (isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name) and node.targets[0].id == flag
            and isinstance(node.value, ast.Constant) and node.value.value is value)


def _guard(tree: ast.Module, extension: str, flag: str) -> tuple[ast.Assign | None, ast.Try | None]:
    """The module-level ``flag = True; try: import extension; except ImportError: flag = False``."""
    default = None
    for node in tree.body:
        if _assigns(node, flag, True):
            default = node
        if (isinstance(node, ast.Try) and any(_imports(s, extension) for s in node.body)
                and any(_assigns(s, flag, False) for h in node.handlers for s in h.body)):
            return default, node
    return default, None


def find_apex_usage(module: types.ModuleType, extension: str, flag: str, calls: tuple[str, ...]) -> ApexUsage:
    return read_module(module, "apex_usage", (extension, flag, calls),
                       lambda tree: _find_apex_usage(tree, extension, flag, calls))


def _find_apex_usage(tree: ast.Module, extension: str, flag: str, calls: tuple[str, ...]) -> ApexUsage:
    flag_default, guarded_import = _guard(tree, extension, flag)
    checks, found, mentions = [], [], False
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and any(isinstance(n, ast.Name) and n.id == flag
                                            for n in ast.walk(node.test)):
            checks.append(node.test)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and isinstance(node.func.value, ast.Name) and node.func.value.id == extension
              and node.func.attr in calls):
            found.append(node)
        if (isinstance(node, ast.alias) and extension in node.name.split(".")) or \
                (isinstance(node, ast.Name) and node.id == extension):
            mentions = True
    return ApexUsage(guarded_import, flag_default, tuple(checks), tuple(found), mentions)
