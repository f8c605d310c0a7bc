"""``scripts/checkpoint_diff.py``, the GPU gate's judge of a resumed training run: hand-made
checkpoints whose largest difference is known, and each way two checkpoints can fail to match."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import checkpoint_diff  # noqa: E402 - a script of this repository, importable once its directory is on the path


def _save(directory, tensors: dict, name: str = "model.safetensors") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / name))


def test_the_largest_difference_is_found_over_shards_and_judged_against_atol(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _save(a, {"x": torch.tensor([1.0, 2.0]), "y": torch.zeros(2, 2)}, "model-00001.safetensors")
    _save(a, {"z": torch.tensor([5.0])}, "model-00002.safetensors")
    _save(b, {"x": torch.tensor([1.0, 2.25]), "y": torch.zeros(2, 2), "z": torch.tensor([5.0])})
    assert checkpoint_diff.main([str(a), str(b), "--atol", "0.25", "--json", str(tmp_path / "d.json")]) == 0
    result = json.loads((tmp_path / "d.json").read_text())
    assert (result["tensors"], result["max_abs_diff"], result["at"], result["within"]) == (3, 0.25, "x", True)
    assert checkpoint_diff.main([str(a), str(b), "--atol", "0.24"]) == 1
    assert "largest |a - b| 0.25 at x (atol 0.24): BEYOND" in capsys.readouterr().out


@pytest.mark.parametrize("other, words", [
    ({"x": torch.zeros(2)}, "only in"),  # a tensor missing
    ({"x": torch.zeros(2), "y": torch.zeros(3)}, "shapes differ: ['y']"),
    ({"x": torch.tensor([0.0, float("nan")]), "y": torch.zeros(2)}, "largest |a - b| inf at x"),
])
def test_missing_tensors_other_shapes_and_nan_are_beyond_any_atol(tmp_path, capsys, other, words):
    a, b = tmp_path / "a", tmp_path / "b"
    _save(a, {"x": torch.zeros(2), "y": torch.zeros(2)})
    _save(b, other)
    assert checkpoint_diff.main([str(a), str(b), "--atol", "1e9"]) == 1
    assert words in capsys.readouterr().out


def test_a_directory_without_tensors_is_an_input_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    _save(tmp_path / "b", {"x": torch.zeros(1)})
    assert checkpoint_diff.main([str(tmp_path / "empty"), str(tmp_path / "b")]) == 2
    assert "no *.safetensors file" in capsys.readouterr().err
