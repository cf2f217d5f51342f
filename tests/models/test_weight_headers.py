"""Weight-file headers read without torch: damaged files refused in one line, shapes compared by name."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from treetrain.models.weight_headers import base_name, header_shapes, shape_mismatch

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "treetrain" / "assets" / "demo_model" / "model.safetensors"
WIDE = ROOT / "treetrain" / "assets" / "demo_model_wide" / "model.safetensors"


def test_an_intact_file_gives_every_tensor_with_its_shape() -> None:
    shapes = header_shapes(DEMO)
    assert shapes["model.embed_tokens.weight"] == (514, 128)
    assert len(shapes) == 38


@pytest.mark.parametrize("damage", ["truncated", "random bytes", "empty", "header only"])
def test_a_damaged_file_is_one_line(tmp_path: Path, damage: str) -> None:
    file = tmp_path / "model.safetensors"
    data = DEMO.read_bytes()
    file.write_bytes(
        {
            "truncated": data[: len(data) // 2],
            "random bytes": os.urandom(100_000),
            "empty": b"",
            "header only": data[: 8 + int.from_bytes(data[:8], "little")],
        }[damage]
    )
    with pytest.raises(ValueError, match="not a complete safetensors file") as caught:
        header_shapes(file)
    assert "\n" not in str(caught.value) and str(file) in str(caught.value)


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        header_shapes(fifo)


def test_shared_tensors_left_out_by_save_model_are_named(tmp_path: Path) -> None:
    """`safetensors.torch.save_model` keeps one of two tied tensors and lists the other in the metadata."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_model

    module = torch.nn.Module()
    module.a = torch.nn.Linear(3, 4, bias=False)
    module.b = torch.nn.Linear(3, 4, bias=False)
    module.b.weight = module.a.weight
    save_model(module, str(tmp_path / "m.safetensors"))
    assert header_shapes(tmp_path / "m.safetensors") == {"a.weight": (4, 3), "b.weight": (4, 3)}


def test_shapes_are_compared_by_name_and_peft_names_map_to_the_base() -> None:
    demo, wide = header_shapes(DEMO), header_shapes(WIDE)
    assert shape_mismatch(demo, demo) is None  # negative control: the same weights fit
    found = shape_mismatch(wide, demo)
    assert found is not None and "is [512, 128] in the file but [128, 128] in the model" in found
    peft = {"base_model.model." + k.replace(".weight", ".base_layer.weight"): v for k, v in wide.items()}
    assert shape_mismatch(peft, demo) is not None
    assert base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert shape_mismatch({"other.name": (1,)}, demo) is None  # a layout the headers cannot judge


def test_a_copy_reads_the_same(tmp_path: Path) -> None:
    shutil.copy(DEMO, tmp_path / "model.safetensors")
    assert header_shapes(tmp_path / "model.safetensors") == header_shapes(DEMO)
