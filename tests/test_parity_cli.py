"""``hetrl parity`` (hetrl.parity): it passes on a tiny checkpoint with every installed backend,
and fails when one backend runs perturbed weights.

Megatron keeps process-global state (torch.distributed, parallel state, the CPU shim), so both
runs happen in one worker subprocess (``python tests/test_parity_cli.py OUT_DIR``): first
``hetrl.cli.main(["parity", "--model", "qwen2", "--json", ...])`` (the tiny Qwen2 default
checkpoint: tied embeddings, q/k/v biases), then, through :func:`hetrl.parity.check` and
:func:`hetrl.parity.report`, transformers and the JAX trainer on a tiny Qwen3 checkpoint against
the Megatron trainer loaded from a copy of it with one weight matrix scaled by 1 + 1e-3, on the
batch the embedded sampler draws from the unperturbed weights (the BF16 backends are left out).
The worker writes both JSON reports, the second table and the exit codes into OUT_DIR.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from hetrl.cli import main

HERE = pathlib.Path(__file__).resolve()
WORKER_TIMEOUT_S = 240
PERTURBED = "model.layers.0.mlp.down_proj.weight"
LIBRARIES = {  # backend -> the libraries it needs, checked here independently of hetrl.parity
    "transformers": ("torch", "transformers"), "jax": ("jax", "flax", "optax"), "jax-bf16": ("jax", "flax", "optax"),
    "megatron": ("torch", "megatron"), "megatron-bf16": ("torch", "megatron"), "embedded": ("jax", "flax"),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("parity")
    proc = subprocess.run([sys.executable, str(HERE), str(out)], capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    assert proc.returncode == 0, f"parity worker failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    codes = json.loads((out / "exit_codes.json").read_text())
    tables = {"cli": proc.stdout, "perturbed": (out / "perturbed.txt").read_text()}
    return {name: (codes[name], json.loads((out / f"{name}.json").read_text()), tables[name]) for name in codes}


@pytest.mark.slow
def test_parity_command_passes_with_every_installed_backend(reports):
    code, report, table = reports["cli"]
    installed = {name for name, libs in LIBRARIES.items() if all(importlib.util.find_spec(m) for m in libs)}
    assert installed, "no backend installed: nothing to test"
    assert {name for name, status in report["backends"].items() if status == "present"} == installed
    in_rows = {b for row in report["rows"] if row["status"] != "absent" for b in row["backends"]}
    assert installed <= in_rows
    for row in report["rows"]:
        assert row["status"] == "PASS" and row["value"] <= row["tolerance"], row
    assert code == 0 and report["passed"]
    checks = {row["check"] for row in report["rows"]}
    assert {"log p(a), fp32", "log p(a), bf16", "loss, fp32, preset hetrl", "AdamW update, fp32"} <= checks
    assert "PASS" in table and "FAIL" not in table  # the table went to stdout


@pytest.mark.slow
def test_parity_fails_when_one_backend_has_perturbed_weights(reports):
    code, report, table = reports["perturbed"]
    rows = {(row["check"], tuple(row["backends"])): row for row in report["rows"]}
    failed = rows[("log p(a), fp32", ("megatron", "transformers"))]
    assert failed["status"] == "FAIL" and failed["value"] > 10 * failed["tolerance"], failed
    assert rows[("log p(a), fp32", ("jax", "transformers"))]["status"] == "PASS"
    assert rows[("loss, fp32, preset hetrl", ("megatron", "jax"))]["status"] == "FAIL"
    assert rows[("AdamW update, fp32", ("megatron", "jax"))]["status"] == "FAIL"
    assert rows[("log p(a), fp32", ("embedded", "transformers"))]["status"] == "PASS"
    assert report["backends"]["jax-bf16"] == report["backends"]["megatron-bf16"] == "absent"
    assert rows[("log p(a), bf16", ("megatron-bf16", "jax-bf16"))]["status"] == "absent"
    assert code == 1 and not report["passed"] and "FAIL" in table


def test_bad_arguments_are_refused(tmp_path, capsys):
    assert main(["parity", "--checkpoint", str(tmp_path), "--model", "qwen2"]) == 2
    assert "cannot be combined" in capsys.readouterr().out
    assert main(["parity", "--checkpoint", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().out


def test_no_checked_row_is_not_a_pass(capsys):
    from rich.console import Console

    from hetrl.models.tiny import TINY_QWEN3
    from hetrl.parity import check, random_batch, report

    batch = random_batch(TINY_QWEN3, seed=0)
    rows = check({}, batch)
    assert rows and all(row.status == "absent" for row in rows)
    assert report(rows, {}, batch, Console()) == 1


# ====================================================================== worker (runs in a subprocess)
def _worker_main(out: pathlib.Path) -> None:
    import numpy as np
    from rich.console import Console

    from hetrl.models import load_state_dict, save_state_dict
    from hetrl.parity import build_parity_checkpoint, check, load_backends, parity_batch, report

    codes = {"cli": main(["parity", "--model", "qwen2", "--json", str(out / "cli.json")])}
    checkpoint = build_parity_checkpoint(out / "qwen3")
    perturbed = pathlib.Path(shutil.copytree(checkpoint, out / "qwen3_perturbed"))
    state = load_state_dict(perturbed)
    state[PERTURBED] = (state[PERTURBED] * np.float32(1 + 1e-3)).astype(np.float32)
    save_state_dict(perturbed, state)
    backends = (load_backends(checkpoint, names=("transformers", "jax", "embedded"))
                | load_backends(perturbed, names=("megatron",)))
    batch = parity_batch(checkpoint, backends["embedded"], seed=0)
    with open(out / "perturbed.txt", "w") as table:
        codes["perturbed"] = report(check(backends, batch), backends, batch, Console(file=table, width=160),
                                    out / "perturbed.json", f"{checkpoint}, megatron from {perturbed}")
    (out / "exit_codes.json").write_text(json.dumps(codes))


if __name__ == "__main__":
    _worker_main(pathlib.Path(sys.argv[1]))
