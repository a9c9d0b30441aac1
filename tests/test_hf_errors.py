"""Bad HF checkpoints give clear errors naming the file and the key; loading needs no transformers."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import aiayn
from aiayn import TransformerConfig
from aiayn.models import CausalLM, TransformerEncoder

BERT = TransformerConfig(vocab_size=40, d_model=24, n_heads=3, d_ff=30, n_encoder_layers=2,
                         n_decoder_layers=0, max_length=16, positions="learned",
                         scale_embeddings=False, embedding_norm=True, type_vocab_size=2,
                         activation="gelu", layer_norm_eps=1e-12, pad_id=0)


@pytest.fixture
def bert_dir(tmp_path):
    directory = tmp_path / "bert"
    aiayn.save_pretrained(TransformerEncoder(BERT), directory)
    return directory


def _edit_weights(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_directory_and_files(tmp_path, bert_dir):
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        aiayn.from_pretrained(tmp_path / "nowhere")
    (bert_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no weights found .*model\.safetensors"):
        aiayn.from_pretrained(bert_dir)
    (bert_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json: missing"):
        aiayn.from_pretrained(bert_dir)


def test_truncated_safetensors(bert_dir):
    path = bert_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        aiayn.from_pretrained(bert_dir)
    path.write_bytes(data[:5])
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated"):
        aiayn.from_pretrained(bert_dir)


def test_malformed_and_unsupported_config(bert_dir):
    config_path = bert_dir / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        aiayn.from_pretrained(bert_dir)
    config_path.write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match=r"config\.json: model_type='gpt_neox' is not supported; "
                                         r"aiayn loads bart, bert, deberta-v2, distilbert, "
                                         r"gemma, gemma2, gemma3_text, gpt2, llama, m2m_100, "
                                         r"marian, mbart, mistral, "
                                         r"modernbert, phi3, qwen2, qwen3, roberta, t5, vit, "
                                         r"xlm-roberta"):
        aiayn.from_pretrained(bert_dir)
    config_path.write_text(json.dumps({**config, "architectures": ["BertForTokenClassification"]}))
    with pytest.raises(ValueError, match="BertForTokenClassification"):
        aiayn.from_pretrained(bert_dir)
    config_path.write_text(json.dumps({**config, "position_embedding_type": "relative_key"}))
    with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
        aiayn.from_pretrained(bert_dir)
    config_path.write_text(json.dumps({**config, "hidden_act": "mish"}))
    with pytest.raises(ValueError, match="hidden_act='mish'"):
        aiayn.from_pretrained(bert_dir)
    del config["hidden_size"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: missing field 'hidden_size'"):
        aiayn.from_pretrained(bert_dir)


def test_missing_key(bert_dir):
    _edit_weights(bert_dir, lambda t: t.pop("encoder.layer.1.attention.self.key.weight"))
    with pytest.raises(ValueError, match=r"missing key 'encoder\.layer\.1\.attention\.self\.key\."
                                         r"weight' \(needed for aiayn parameter 'encoder\.layers\.1"
                                         r"\.self_attention\.qkv_proj\.weight'\)"):
        aiayn.from_pretrained(bert_dir)


def test_extra_key(bert_dir):
    _edit_weights(bert_dir, lambda t: t.update({"encoder.layer.2.output.dense.weight":
                                                    torch.zeros(24, 30)}))
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected key\(s\) "
                                         r"'encoder\.layer\.2\.output\.dense\.weight'"):
        aiayn.from_pretrained(bert_dir)


def test_shape_mismatch(bert_dir):
    _edit_weights(bert_dir, lambda t: t.update({"encoder.layer.0.intermediate.dense.weight":
                                                    torch.zeros(31, 24)}))
    with pytest.raises(ValueError, match=r"model\.safetensors: shape mismatch for "
                                         r"'encoder\.layer\.0\.intermediate\.dense\.weight' "
                                         r"\(31, 24\) -> aiayn 'encoder\.layers\.0\.feedforward\."
                                         r"linear1\.weight' \(30, 24\)"):
        aiayn.from_pretrained(bert_dir)


def test_tied_keys_that_differ(tmp_path):
    config = TransformerConfig(vocab_size=40, d_model=24, n_heads=3, d_ff=30, n_encoder_layers=0,
                               n_decoder_layers=1, max_length=16, norm_first=True,
                               positions="learned", scale_embeddings=False)
    aiayn.save_pretrained(CausalLM(config), tmp_path)
    _edit_weights(tmp_path, lambda t: t.update({"lm_head.weight": torch.zeros(40, 24)}))
    with pytest.raises(ValueError, match=r"'lm_head\.weight' differs from 'transformer\.wte\."
                                         r"weight', but the config ties them"):
        aiayn.from_pretrained(tmp_path)


def test_pytorch_bin_is_read_weights_only(bert_dir):
    """A legacy pytorch_model.bin loads (weights_only=True); one with a pickled object is refused."""
    tensors = load_file(bert_dir / "model.safetensors")
    (bert_dir / "model.safetensors").unlink()
    torch.save(tensors, bert_dir / "pytorch_model.bin")
    model = aiayn.from_pretrained(bert_dir)
    torch.testing.assert_close(model.encoder.embeddings.tokens.weight,
                               tensors["embeddings.word_embeddings.weight"])
    torch.save({"evil": object()}, bert_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: not a readable weights-only"):
        aiayn.from_pretrained(bert_dir)


def test_loading_never_imports_transformers(bert_dir):
    code = (f"import sys, aiayn; aiayn.from_pretrained({str(bert_dir)!r}); "
            f"assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_overrides_and_config_values_name_the_source(bert_dir):
    with pytest.raises(ValueError, match="unknown TransformerConfig field.*: d_modle"):
        aiayn.from_pretrained(bert_dir, d_modle=3)
    with pytest.raises(ValueError, match="task must be one of"):
        aiayn.from_pretrained(bert_dir, task="translation")
    config_path = bert_dir / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_attention_heads": 5}))  # 24 % 5 != 0
    with pytest.raises(ValueError, match=r"config\.json: d_model \(24\) must be divisible by "
                                         r"n_heads \(5\)"):
        aiayn.from_pretrained(bert_dir)


def test_sharded_checkpoint_and_dtype(bert_dir):
    """model.safetensors.index.json with two shards loads; a missing shard is named."""
    tensors = load_file(bert_dir / "model.safetensors")
    (bert_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({key: tensors[key] for key in keys}, bert_dir / shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {key: shard for shard, keys in shards.items()
                                            for key in keys}}
    (bert_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    model = aiayn.from_pretrained(bert_dir, dtype=torch.bfloat16)
    assert model.encoder.embeddings.tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(model.encoder.layers[1].feedforward.linear2.weight.float(),
                               tensors["encoder.layer.1.output.dense.weight"].bfloat16().float())
    (bert_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors: missing "
                                                r"\(listed in .*model\.safetensors\.index\.json\)"):
        aiayn.from_pretrained(bert_dir)


def test_legacy_layouts_are_accepted(tmp_path):
    """Older transformers saved every tied alias and some buffers: equal aliases and the known
    buffers (GPT-2's attn.bias / attn.masked_bias) load; nothing else is skipped."""
    config = TransformerConfig(vocab_size=40, d_model=24, n_heads=3, d_ff=30, n_encoder_layers=0,
                               n_decoder_layers=2, max_length=16, norm_first=True,
                               positions="learned", scale_embeddings=False)
    model = CausalLM(config)
    aiayn.save_pretrained(model, tmp_path)

    def add_legacy(t):
        t["lm_head.weight"] = t["transformer.wte.weight"].clone()
        for i in range(2):
            t[f"transformer.h.{i}.attn.bias"] = torch.ones(1, 1, 16, 16).tril()
            t[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)

    _edit_weights(tmp_path, add_legacy)
    loaded = aiayn.from_pretrained(tmp_path)
    ids = torch.randint(0, 40, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model.eval()(ids), atol=0, rtol=0)
