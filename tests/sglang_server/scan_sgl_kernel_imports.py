"""List the ``sgl_kernel`` names an installed SGLang imports on CPU (stdlib only).

    .venv-sglang/bin/python tests/sglang_server/scan_sgl_kernel_imports.py

Prints every ``from sgl_kernel[...] import NAME`` whose NAME ends in ``_cpu`` or that sits
under an ``if`` whose test mentions cpu (``_is_cpu``, ``is_cpu()``), with file:line and
whether it runs at module import ("top"). standins/sgl_kernel must define all of them;
``torch.ops.sgl_kernel.*`` uses are not listed (SGLang reaches them only on the Intel-AMX
path, which the stand-in keeps off, except murmur_hash32_cpu: see its docstring).
"""

import ast
import collections
import importlib.util
import pathlib
import sys


def scan(root: pathlib.Path) -> dict:
    found = collections.defaultdict(set)

    def visit(node, in_cpu: bool, top: bool, path: pathlib.Path):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] == "sgl_kernel":
                for alias in child.names:
                    if alias.name.endswith("_cpu") or in_cpu:
                        where = f"{path.relative_to(root.parent)}:{child.lineno}{' top' if top else ''}"
                        found[(child.module, alias.name)].add(where)
            elif isinstance(child, ast.If):
                test = ast.unparse(child.test).lower()
                cpu = "cpu" in test and "amx" not in test
                for b in child.body:
                    visit(ast.Module(body=[b], type_ignores=[]), in_cpu or cpu, top, path)
                for b in child.orelse:
                    visit(ast.Module(body=[b], type_ignores=[]), in_cpu, top, path)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, in_cpu, False, path)
            else:
                visit(child, in_cpu, top, path)

    for path in sorted(root.rglob("*.py")):
        if "multimodal_gen" in path.parts:  # diffusion runtime, not the LLM server
            continue
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except SyntaxError:
            continue
        visit(tree, False, True, path)
    return found


def main() -> int:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        print("sglang is not importable from this interpreter", file=sys.stderr)
        return 1
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
    for (module, name), where in sorted(scan(root).items()):
        print(f"{module}.{name}: {', '.join(sorted(where))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
