"""Checkpoint loading: round trip, sharding, tokenizer, stop tokens and every bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specloop.checkpoint import expected_shapes, load_config, load_model, load_tokenizer, stop_token_ids
from specloop.checkpoint.random_checkpoint import preset_config
from specloop.cli import main as cli_main
from specloop.errors import CheckpointError, ConfigError
from tests.conftest import TINY, make_checkpoint


@pytest.fixture()
def ckpt(tmp_path, tiny_ckpt) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_round_trip_exact(tiny_ckpt):
    stored = load_file(str(tiny_ckpt / "model.safetensors"))
    model, report = load_model(tiny_ckpt, dtype=torch.float32)
    params = dict(model.named_parameters())
    assert set(params) == set(stored) == set(expected_shapes(model.config))
    for name, tensor in stored.items():
        assert torch.equal(params[name], tensor.float()), name
    assert report.num_tensors == len(stored)


def test_sharded_round_trip(tmp_path):
    folder = make_checkpoint(tmp_path / "sharded", TINY, seed=5, dtype=torch.bfloat16, max_shard_bytes=40_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3 and not (folder / "model.safetensors").exists()
    model, _ = load_model(folder, dtype="bfloat16")
    for shard in shards:
        for name, tensor in load_file(str(folder / shard)).items():
            assert torch.equal(model.get_parameter(name), tensor), name
    assert model.dtype == torch.bfloat16


def test_bf16_load_keeps_bf16_without_fp32_copy(tmp_path):
    folder = make_checkpoint(tmp_path / "bf16", TINY, seed=6, dtype=torch.bfloat16)
    model, report = load_model(folder, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert report.bytes_loaded == sum(p.numel() * 2 for p in model.parameters())


def test_tokenizer_chat_template_and_stops(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    text = "def f(x):\n    return x + 1  # é ✓"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert stop_token_ids(load_config(tiny_ckpt), tok) == (0, 2)


def test_stop_ids_from_config_list(ckpt):
    _edit_config(ckpt, eos_token_id=[0, 5])
    assert stop_token_ids(load_config(ckpt), load_tokenizer(ckpt)) == (0, 2, 5)


def test_config_fields_read():
    cfg = preset_config("ouro-1.4b")
    back = type(cfg).from_hf_dict(cfg.to_hf_dict())
    assert back == cfg
    assert cfg.kv_bytes_per_token() == 768 * 1024  # ouro.md: 768 KiB per token at 4 loops


def _error_of(fn) -> str:
    with pytest.raises((CheckpointError, ConfigError)) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_folder(tmp_path):
    assert "does not exist" in _error_of(lambda: load_model(tmp_path / "nope"))


def test_a_file_is_not_a_checkpoint_folder(ckpt):
    """A path that exists but is a file (`specloop serve /etc/passwd`) is not said to be missing."""
    message = _error_of(lambda: load_model(ckpt / "config.json"))
    assert "is not a checkpoint folder" in message and "does not exist" not in message


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    assert "no config.json" in _error_of(lambda: load_model(ckpt))


def test_wrong_model_type(ckpt):
    _edit_config(ckpt, model_type="llama")
    assert "unsupported model_type 'llama'" in _error_of(lambda: load_model(ckpt))


@pytest.mark.parametrize("change, words", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"use_sliding_window": True, "sliding_window": 128}, "sliding-window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"early_exit_threshold": 1.5}, "early_exit_threshold"),
])
def test_unsupported_options(ckpt, change, words):
    _edit_config(ckpt, **change)
    assert words in _error_of(lambda: load_model(ckpt))


def test_truncated_safetensors(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    assert "truncated" in _error_of(lambda: load_model(ckpt))


def test_corrupted_header(ckpt):
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[10:20] = b"\xff" * 10
    path.write_bytes(bytes(data))
    assert "corrupted" in _error_of(lambda: load_model(ckpt))


def test_tiny_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"abc")
    assert "truncated" in _error_of(lambda: load_model(ckpt))


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    assert "neither model.safetensors" in _error_of(lambda: load_model(ckpt))


def _rewrite(ckpt: Path, edit) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


def test_missing_tensor_named(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in _error_of(lambda: load_model(ckpt))


def test_unexpected_tensor_named(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.q_norm.weight", torch.ones(4)))
    assert "unexpected tensor model.layers.0.self_attn.q_norm.weight" in _error_of(lambda: load_model(ckpt))


def test_wrong_shape_named(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.norm.weight", torch.ones(65)))
    message = _error_of(lambda: load_model(ckpt))
    assert "model.norm.weight" in message and "(65,)" in message


def test_wrong_dtype_named(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.norm.weight", torch.ones(64, dtype=torch.int32)))
    assert "model.norm.weight has dtype I32" in _error_of(lambda: load_model(ckpt))


def test_missing_shard(tmp_path):
    folder = make_checkpoint(tmp_path / "sharded", TINY, seed=5, max_shard_bytes=100_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (folder / victim).unlink()
    assert f"shard {victim}" in _error_of(lambda: load_model(folder))


def test_missing_tokenizer(ckpt):
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer_config.json").unlink()
    assert "no tokenizer" in _error_of(lambda: load_tokenizer(ckpt))


def test_cli_prints_one_error_line(ckpt, capsys):
    _edit_config(ckpt, model_type="llama")
    code = cli_main(["generate", "--model", str(ckpt), "--prompt", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: unsupported model_type")


def test_cli_random_checkpoint_and_generate(tmp_path, capsys):
    out = tmp_path / "rc"
    assert cli_main(["random-checkpoint", str(out), "--preset", "tiny", "--seed", "3",
                     "--num-hidden-layers", "1", "--hidden-size", "32", "--head-dim", "8"]) == 0
    cfg = load_config(out)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (1, 32, 8)
    capsys.readouterr()
    assert cli_main(["generate", "--model", str(out), "--prompt", "hello", "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out.endswith("\n")
