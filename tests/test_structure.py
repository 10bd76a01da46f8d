"""The shape the trainer layer was redesigned to (issue 26), held by a test so it does not drift back:
no module of `megalign/trainers/` or `launch/` over 500 lines, no function there over 60 lines, and no
module of the package importing the test oracle `megalign.ops.reference` except the reference path itself
(the ops' pure-torch fallback, `megalign/ops/*.py`)."""
import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYER = sorted(glob.glob(os.path.join(ROOT, "megalign", "trainers", "*.py")) + glob.glob(os.path.join(ROOT, "launch", "*.py")))


def _relative(path):
    return os.path.relpath(path, ROOT)


def test_the_layer_exists():
    assert len(LAYER) > 20 and any(p.endswith("online.py") for p in LAYER)


def test_no_module_over_500_lines():
    long = {_relative(p): n for p in LAYER if (n := sum(1 for _ in open(p, encoding="utf-8"))) > 500}
    assert not long, long


def test_no_function_over_60_lines():
    long = {}
    for path in LAYER:
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long[f"{_relative(path)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long


def test_only_the_ops_import_the_reference_path():
    importers = []
    for path in glob.glob(os.path.join(ROOT, "megalign", "**", "*.py"), recursive=True):
        if os.sep + os.path.join("ops", "") in path:
            continue  # the ops themselves: their pure-torch fallback is the reference path
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(n.startswith("megalign.ops.reference") for n in names) or (
                    isinstance(node, ast.ImportFrom) and node.module == "megalign.ops"
                    and any(a.name == "reference" for a in node.names)):
                importers.append(_relative(path))
    assert not importers, importers
