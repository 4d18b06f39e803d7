"""The quantize stage streams: peak host memory stays far below the whole model."""

from typer.testing import CliRunner

from qerl_pipe.cli import app
from tests.conftest import make_tiny_model, read_json
from pathlib import Path

DIMS = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=16, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6)


def test_peak_host_memory_is_a_fraction_of_the_model(tmp_path):
    model = make_tiny_model(tmp_path / "model", "llama", dims=DIMS, shard_mb=6)
    result = CliRunner().invoke(app, ["quantize", "--model", str(model), "--artifacts", str(tmp_path / "a"),
                                      "--set", "quantize.quality.perplexity=never"])
    assert result.exit_code == 0, result.stderr
    summary = read_json(Path(result.stdout.strip().splitlines()[-1]) / "manifest.json")["summary"]
    assert summary["shards"] >= 8
    # The whole bf16 model is ~100 MB; streaming holds one 6 MB shard, its output and the fp32
    # temporaries of one tensor (about 30 MB measured here).
    assert summary["peak_host_memory_mb"] < 0.5 * summary["size_mb"]["in"], summary
