"""stack_checkpoints on Hugging Face ``save_pretrained`` folders: single-file ones and sharded ones (a
``model.safetensors.index.json`` or ``pytorch_model.bin.index.json`` and the shards it lists), read one shard at
a time.

The reference is the N original models themselves: every stacked parameter and buffer slice equals the original's
bit for bit, and the stacked forward equals a loop over the originals. The models are tiny GPT-2 and BERT models
built from a config (tied weights: ``lm_head.weight``, ``cls.predictions.decoder.*``, which safetensors files
omit); nothing is downloaded. Files (single ``.pt`` files, checksums, truncation) are tested in
test_convert_checkpoint.py, test_save.py and test_clear_errors.py; the folders reuse that code path here.
"""

from __future__ import annotations

import json
import pathlib
import re
import weakref

import pytest
import safetensors.torch
import torch

import batchlayers as bl
import batchlayers.checkpoint as checkpoint_module

transformers = pytest.importorskip("transformers")
huggingface_hub = pytest.importorskip("huggingface_hub")
transformers.logging.set_verbosity_error()

N = 3  # checkpoints stacked in every test
SHARD = "50KB"  # every folder below is cut into 2 or 3 shards at this size

ARCHITECTURES = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
    ),
    "bert": lambda: transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        )
    ),
}


def _model(arch: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ARCHITECTURES[arch]().eval()


# -- how each entry of paths is written ----------------------------------------------------------------------


def _sharded_safetensors(model, folder: pathlib.Path) -> pathlib.Path:
    model.save_pretrained(folder, max_shard_size=SHARD)  # tied weights are kept under one name
    return folder


def _sharded_bin(model, folder: pathlib.Path) -> pathlib.Path:
    # transformers 5 writes safetensors only; huggingface_hub writes the torch format transformers 4 wrote
    # (pytorch_model-0000k-of-0000n.bin, pytorch_model.bin.index.json), tied weights under each name
    folder.mkdir()
    huggingface_hub.save_torch_state_dict(model.state_dict(), folder, max_shard_size=SHARD, safe_serialization=False)
    return folder


def _single_safetensors(model, folder: pathlib.Path) -> pathlib.Path:
    model.save_pretrained(folder)
    return folder


def _single_bin(model, folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


def _file(model, path: pathlib.Path) -> pathlib.Path:
    safetensors.torch.save_model(model, str(path))  # a single file, as before folders were read
    return path


WRITERS = {
    "safetensors-folder": _sharded_safetensors,
    "bin-folder": _sharded_bin,
    "safetensors-index": lambda m, f: _sharded_safetensors(m, f) / "model.safetensors.index.json",
    "bin-index": lambda m, f: _sharded_bin(m, f) / "pytorch_model.bin.index.json",
    "single-safetensors-folder": _single_safetensors,
    "single-bin-folder": _single_bin,
    "file": lambda m, f: _file(m, f.with_suffix(".safetensors")),
}
# each layout: how checkpoint i of N is written (mixed: one of each kind in one call)
LAYOUTS = {
    "safetensors-sharded": ["safetensors-folder"] * N,
    "bin-sharded": ["bin-folder"] * N,
    "index-paths": ["safetensors-index", "bin-index", "safetensors-index"],
    "single-file-folders": ["single-safetensors-folder", "single-bin-folder", "single-safetensors-folder"],
    "mixed": ["safetensors-folder", "single-bin-folder", "file"],
}


def _write(layout: str, models, root: pathlib.Path) -> list[pathlib.Path]:
    return [WRITERS[kind](model, root / f"ckpt-{i}") for i, (kind, model) in enumerate(zip(LAYOUTS[layout], models))]


def _inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (4, 10))
    mask = torch.ones(4, 10, dtype=torch.long)
    mask[::2, 7:] = 0  # padded sequences: the mask takes part
    return {"input_ids": ids, "attention_mask": mask}


def _assert_slices_equal(stacked: torch.nn.Module, models) -> None:
    """Every parameter and buffer of every original, under every name, bit for bit in its slice."""
    tensors = {**dict(stacked.named_parameters(remove_duplicate=False)), **dict(stacked.named_buffers())}
    for i, model in enumerate(models):
        originals = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
        assert set(originals) == set(tensors)
        for name, original in originals.items():
            value = tensors[name]
            value = value[i] if value.dim() == original.dim() + 1 else value  # a buffer shared by all models
            assert value.dtype == original.dtype and torch.equal(value, original), f"model {i}: {name}"


# -- stacked folders equal the originals ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_folders_stack_to_the_original_models(arch: str, layout: str, tmp_path) -> None:
    models = [_model(arch, seed) for seed in range(N)]
    paths = _write(layout, models, tmp_path)
    if layout.endswith("sharded"):
        assert all(len(list(p.glob("*-of-*"))) >= 2 for p in paths), "each folder is sharded"

    stacked = bl.stack_checkpoints(_model(arch, 99), paths).eval()

    _assert_slices_equal(stacked, models)
    if arch == "gpt2":
        assert stacked.lm_head.weight is stacked.transformer.wte.weight  # tied as in the originals
    inputs = _inputs()
    with torch.no_grad():
        out = stacked(**{k: v.expand(N, -1, -1) for k, v in inputs.items()}).logits
        loop = torch.stack([model(**inputs).logits for model in models])
    torch.testing.assert_close(out, loop, atol=1e-5, rtol=1e-4)


def test_bin_folder_with_tied_duplicates_reads_the_first_name(tmp_path) -> None:
    """A torch-format index lists a tied weight under both names; the model's first name is the one read."""
    models = [_model("gpt2", seed) for seed in range(2)]
    paths = _write("bin-sharded", models, tmp_path)[:2]
    weight_map = json.loads((paths[0] / "pytorch_model.bin.index.json").read_text())["weight_map"]
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(weight_map)
    stacked = bl.stack_checkpoints(_model("gpt2", 99), paths)
    for i, model in enumerate(models):
        assert torch.equal(stacked.lm_head.weight[i], model.transformer.wte.weight)


# -- one shard at a time -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_reads_one_shard_at_a_time(fmt: str, tmp_path, monkeypatch) -> None:
    """Each shard is read once, in order, and none of a shard's tensors is alive when the next one is read:
    the peak is one shard, not one model (the loader is instrumented; nothing is timed)."""
    models = [_model("gpt2", seed) for seed in range(N)]
    folders = _write(f"{fmt}-sharded", models, tmp_path)
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    shards = [sorted(set(json.loads((f / index).read_text())["weight_map"].values())) for f in folders]
    read, alive_at_read, sizes = [], [], []
    loaded: list[weakref.ref] = []
    load = checkpoint_module._load

    def instrumented(path, *args, **kwargs):
        alive_at_read.append(sum(ref() is not None for ref in loaded))
        read.append(pathlib.Path(path))
        state = load(path, *args, **kwargs)
        sizes.append(len(state))
        loaded.extend(weakref.ref(t) for t in state.values())
        return state

    monkeypatch.setattr(checkpoint_module, "_load", instrumented)
    stacked = bl.stack_checkpoints(_model("gpt2", 99), folders)
    monkeypatch.undo()

    assert read == [folder / shard for folder, names in zip(folders, shards) for shard in names]
    assert all(len(names) >= 2 for names in shards)
    assert alive_at_read == [0] * len(read), "a shard was read while another one's tensors were alive"
    whole = len(models[0].state_dict())
    assert max(sizes) < whole - 1, f"a read held {max(sizes)} of the model's {whole} tensors"
    assert sum(ref() is not None for ref in loaded) == 0  # the last shard is freed too
    _assert_slices_equal(stacked, models)


# -- bad folders and indexes ---------------------------------------------------------------------------------


def _index(folder: pathlib.Path) -> pathlib.Path:
    return next(folder.glob("*.index.json"))


def _edit_weight_map(edit):
    def damage(folder: pathlib.Path) -> None:
        index = _index(folder)
        data = json.loads(index.read_text())
        edit(data["weight_map"])
        index.write_text(json.dumps(data))

    return damage


def _shard(folder: pathlib.Path, k: int = 1) -> pathlib.Path:
    return sorted(folder.glob("*-of-*"))[k]


def _read(path: pathlib.Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return safetensors.torch.load_file(path)
    return torch.load(path, weights_only=True)


def _rewrite_shard(edit, checksum: bool = False):
    def damage(folder: pathlib.Path) -> None:
        path = _shard(folder)
        state = _read(path)
        edit(state)
        bl.save(state, path, checksum=checksum)

    return damage


def _first(state: dict[str, torch.Tensor]) -> str:
    return sorted(state)[0]


def _flip_a_byte(folder: pathlib.Path) -> None:
    """Shard 2 saved with a checksum, then one byte of its first tensor changed on disk."""
    _rewrite_shard(lambda state: None, checksum=True)(folder)
    path = _shard(folder)
    state = _read(path)
    if "__batchlayers_checksum__" in state:
        state = state["data"]
    tensor = state[_first(state)]
    data = bytearray(path.read_bytes())
    start = data.find(tensor.contiguous().numpy().tobytes())
    data[start + 1] ^= 0x01
    path.write_bytes(bytes(data))


def _only_config(folder: pathlib.Path) -> None:
    for path in folder.iterdir():
        path.unlink()
    (folder / "config.json").write_text("{}")


SHARD_NAME = r"[^']*(model|pytorch_model)-00002-of-00003\.(safetensors|bin)"
INDEX_NAME = r"[^']*ckpt-1[/\\](model\.safetensors|pytorch_model\.bin)\.index\.json"

# id, how checkpoint 2 of 2 is damaged, the exception, its message, whether it is refused before any file is read
BAD = [
    ("no-checkpoint", _only_config, ValueError, r"'[^']*ckpt-1' is a directory without a checkpoint: it holds none of model\.safetensors, .* it holds \['config\.json'\]", True),  # noqa: E501
    ("shard-file-missing", lambda f: _shard(f).unlink(), ValueError, rf"'{INDEX_NAME}' places \d+ tensors \(the first '[\w.]+'\) in the shard '(model|pytorch_model)-00002-of-00003\.(safetensors|bin)', but '{SHARD_NAME}' does not exist", True),  # noqa: E501
    ("unknown-tensor", _edit_weight_map(lambda m: m.update({"transformer.h.7.mlp.c_fc.weight": next(iter(m.values()))})), ValueError, rf"'{INDEX_NAME}' \(its weight_map\) does not fit GPT2LMHeadModel: missing keys \[\], unexpected keys \['transformer\.h\.7\.mlp\.c_fc\.weight'\]", True),  # noqa: E501
    ("index-lacks-tensor", _edit_weight_map(lambda m: m.pop("transformer.h.1.ln_2.bias")), ValueError, rf"'{INDEX_NAME}' \(its weight_map\) does not fit GPT2LMHeadModel: missing keys \['transformer\.h\.1\.ln_2\.bias'\], unexpected keys \[\]$", True),  # noqa: E501
    ("index-not-json", lambda f: _index(f).write_text("{not json"), ValueError, rf"'{INDEX_NAME}' is not a checkpoint index: it is not a JSON file", True),  # noqa: E501
    ("index-without-weight-map", lambda f: _index(f).write_text('{"metadata": {}}'), ValueError, rf"'{INDEX_NAME}' is not a checkpoint index: it has no \"weight_map\"", True),  # noqa: E501
    ("shard-lacks-tensor", _rewrite_shard(lambda s: s.pop(_first(s))), ValueError, rf"'{SHARD_NAME}' lacks the tensor '[\w.]+' that its index '{INDEX_NAME}' places in it", False),  # noqa: E501
    ("shard-holds-unlisted-tensor", _rewrite_shard(lambda s: s.update({"transformer.extra": torch.ones(2)})), ValueError, rf"'{SHARD_NAME}' holds the tensor 'transformer\.extra', which its index '{INDEX_NAME}' does not place in it", False),  # noqa: E501
    ("wrong-shape", _rewrite_shard(lambda s: s.update({_first(s): torch.zeros(7)})), ValueError, rf"'[\w.]+' has shape \(7,\) in '{SHARD_NAME}' but \(\d+,\) in GPT2LMHeadModel", False),  # noqa: E501
    ("checksum-differs", _flip_a_byte, ValueError, rf"stack_checkpoints \(checkpoint 2 of 2, shard 2 of 3\): '{SHARD_NAME}' is corrupt: the bytes of tensor '[\w.]+' differ", False),  # noqa: E501
    ("shard-truncated", lambda f: _shard(f).write_bytes(_shard(f).read_bytes()[:1000]), ValueError, rf"stack_checkpoints \(checkpoint 2 of 2, shard 2 of 3\): '{SHARD_NAME}' is (truncated or corrupt|not a safetensors file)", False),  # noqa: E501
]  # fmt: skip


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_folder_names_the_file_and_the_tensor(case, fmt: str, tmp_path, monkeypatch) -> None:
    _, damage, exception, pattern, before_reading = case
    folders = _write(f"{fmt}-sharded", [_model("gpt2", seed) for seed in range(2)], tmp_path)[:2]
    damage(folders[1])
    read = []
    load = checkpoint_module._load
    monkeypatch.setattr(checkpoint_module, "_load", lambda path, *a, **k: read.append(path) or load(path, *a, **k))
    with pytest.raises(exception, match=pattern):
        bl.stack_checkpoints(_model("gpt2", 99), folders)
    assert not read if before_reading else read, "folders and indexes are checked before any file is read"


def test_bad_single_file_folder_names_the_file(tmp_path) -> None:
    folder = _single_safetensors(_model("gpt2", 0), tmp_path / "ckpt")
    state = safetensors.torch.load_file(folder / "model.safetensors")
    del state["transformer.h.0.attn.c_proj.bias"]
    safetensors.torch.save_file(state, folder / "model.safetensors")
    pattern = r"'[^']*ckpt[/\\]model\.safetensors' does not fit GPT2LMHeadModel: missing keys \['transformer\.h\.0\.attn\.c_proj\.bias'\], unexpected keys \[\]$"  # noqa: E501
    with pytest.raises(ValueError, match=pattern):
        bl.stack_checkpoints(_model("gpt2", 99), [folder])


@pytest.mark.parametrize("layout", ["safetensors-sharded", "single-file-folders", "index-paths"])
def test_key_is_refused_for_folders(layout: str, tmp_path) -> None:
    paths = _write(layout, [_model("gpt2", seed) for seed in range(N)], tmp_path)
    pattern = rf"stack_checkpoints \(checkpoint 1 of 3\): key='model' .* but '{re.escape(str(paths[0]))}[^']*' is a save_pretrained folder or index"  # noqa: E501
    with pytest.raises(ValueError, match=pattern):
        bl.stack_checkpoints(_model("gpt2", 99), paths, key="model")


def test_shared_buffer_that_differs_in_a_shard_is_stored_per_model(tmp_path) -> None:
    """A buffer kept as one copy for all models (a module without parameters, equal in the checkpoints read so
    far) that differs in a later shard is stored per model from there on, as for single files."""

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", torch.ones(4))

        def forward(self, x):
            return x * self.mask

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.masked = Masked()

        def forward(self, x):
            return self.masked(self.fc(x))

    folders, nets = [], []
    for i in range(2):
        net = Net()
        net.masked.mask[0] = i
        folder = tmp_path / f"ckpt-{i}"
        folder.mkdir()
        huggingface_hub.save_torch_state_dict(net.state_dict(), folder, max_shard_size=64)
        folders.append(folder)
        nets.append(net)
    stacked = bl.stack_checkpoints(Net(), folders)
    assert torch.equal(stacked.masked.mask, torch.stack([n.masked.mask for n in nets]))
    x = torch.randn(2, 3, 4)
    expected = torch.stack([n(x[i]) for i, n in enumerate(nets)])
    assert torch.allclose(stacked(x), expected, atol=1e-6)
