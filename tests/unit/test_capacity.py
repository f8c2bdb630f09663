"""KV capacity arithmetic (router/capacity.py) and ``prefix-router capacity``: the seed's worked
example exactly, configs read by transformers' AutoConfig from files written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.cli import main as cli_main
from router.decision import capacity

SEED_FLAGS = ["--params", "14e9", "--layers", "48", "--q-heads", "40", "--kv-heads", "8",
              "--head-dim", "128", "--tflops", "400"]


def _write_config(directory: Path, **fields: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fields))
    return directory


def test_seed_worked_example_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["capacity", *SEED_FLAGS]) == 0
    out = capsys.readouterr().out
    assert "KV per token: 196,608 bytes (192 KiB) = 2 x 48 layers x 8 KV heads x 128 x 2 bytes" in out
    assert "shared prefix of 12,000 tokens: 750 blocks (12,000 tokens reusable), 2.20 GiB" in out
    assert "miss: 12,100 tokens" in out and "1.03 s" in out
    assert "hit:  100 new tokens after 12,000 cached" in out and "10.0 ms" in out


def test_seed_worked_example_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["capacity", *SEED_FLAGS, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_bytes_per_token"] == 196_608 == 192 * 1024
    assert plan["prefix_blocks"] == 750
    assert plan["prefix_bytes"] == 750 * 16 * 196_608
    assert round(plan["prefix_bytes"] / 2**30, 1) == 2.2
    # the seed: about 4.1e14 FLOPs, about one second; about 4e12 FLOPs, about 10 ms
    assert round(plan["miss_prefill_flops"] / 1e14, 1) == 4.1
    assert round(plan["miss_prefill_s"], 1) == 1.0
    assert round(plan["hit_prefill_flops"] / 1e12) == 4
    assert round(plan["hit_prefill_s"] * 1e3) == 10
    # weights 14e9 x 2 bytes; (80 GB x 0.9 - 28 GB) / (16 x 196,608 bytes)
    assert plan["num_gpu_blocks"] == int((72e9 - 28e9) // (16 * 196_608)) == 13_987
    assert plan["prefixes_that_fit"] == 13_987 // 750


def test_llama_config_dir_with_safetensors_index(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model = _write_config(tmp_path / "tiny-llama", model_type="llama", hidden_size=256,
                          intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, vocab_size=1000, torch_dtype="bfloat16",
                          tie_word_embeddings=False)
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 3_000_000_000}, "weight_map": {}}))
    assert cli_main(["capacity", str(model), "--json", "--gpu-memory-gb", "24",
                     "--prefix-tokens", "40"]) == 0
    plan = json.loads(capsys.readouterr().out)
    head_dim = 256 // 8
    assert plan["kv_bytes_per_token"] == 2 * 4 * 2 * head_dim * 2 == 1024  # GQA: 2 KV heads
    assert plan["weight_bytes"] == 3e9 and plan["model"]["weight_source"] == "safetensors files"
    assert plan["num_gpu_blocks"] == int((24e9 * 0.9 - 3e9) // (16 * 1024))
    # estimated params: embeddings twice, q/k/v/o and a gated MLP per layer
    params = 1000 * 256 * 2 + 4 * (256 * head_dim * (2 * 8 + 2 * 2) + 3 * 256 * 512)
    assert plan["model"]["params"] == params
    # a 40-token prefix: 3 blocks held, 32 tokens reusable, 8 lost to rounding
    assert plan["prefix_blocks"] == 3 and plan["prefix_reusable_tokens"] == 32
    assert any("8 tokens past a block boundary" in note for note in plan["notes"])


def test_kv_cache_dtype_fp8_halves_the_figure(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    model = _write_config(tmp_path / "m", model_type="llama", hidden_size=256,
                          intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, vocab_size=1000, torch_dtype="bfloat16")
    assert cli_main(["capacity", str(model), "--json", "--kv-cache-dtype", "fp8"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == 512


def test_sliding_window_model_gets_a_statement_not_a_number(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _write_config(tmp_path / "mistral", model_type="mistral", hidden_size=256,
                          intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, vocab_size=1000, sliding_window=4096,
                          torch_dtype="bfloat16")
    assert cli_main(["capacity", str(model), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_bytes_per_token"] is None and plan["num_gpu_blocks"] is None
    assert plan["prefix_bytes"] is None and plan["prefixes_that_fit"] is None
    assert any("4 of 4 layers keep only the last 4096 tokens" in n for n in plan["notes"])
    assert cli_main(["capacity", str(model)]) == 0
    assert "KV per token: not computed (see notes)" in capsys.readouterr().out


def test_qwen_config_with_sliding_window_disabled_is_full_attention(tmp_path: Path) -> None:
    from transformers import AutoConfig

    model = _write_config(tmp_path / "qwen", model_type="qwen2", hidden_size=256,
                          intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, vocab_size=1000, sliding_window=4096,
                          use_sliding_window=False, torch_dtype="bfloat16")
    shape = capacity.model_shape_from_config(AutoConfig.from_pretrained(str(model)))
    assert shape.sliding_layers == 0 and shape.kv_bytes_per_token == 1024


def test_mla_model_counts_the_latent(tmp_path: Path) -> None:
    config = type("DeepseekV3Like", (), {
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "torch_dtype": "bfloat16", "vocab_size": 129280,
        "intermediate_size": 18432})()
    shape = capacity.model_shape_from_config(config, params=37e9)
    result = capacity.plan(shape, capacity.GpuBudget(tensor_parallel_size=8))
    assert result.kv_bytes_per_token == 61 * (512 + 64) * 2  # one latent per layer, no K/V pair
    assert any(note.startswith("MLA:") for note in result.notes)


def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["capacity", "--layers", "48"]) == 2
    assert "give MODEL_DIR or all of --params" in capsys.readouterr().err
    assert cli_main(["capacity", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert cli_main(["capacity", *SEED_FLAGS, "--kv-cache-dtype", "int3"]) == 2
    assert "unknown dtype 'int3'" in capsys.readouterr().err
    with pytest.raises(capacity.CapacityError):
        capacity.ModelShape(params=1e9, num_layers=4, num_q_heads=6, num_kv_heads=4, head_dim=64)
