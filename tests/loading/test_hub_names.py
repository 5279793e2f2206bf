"""Hub model names as users type them, GGUF quant labels and split parts: pure functions, no
network."""

from __future__ import annotations

import pytest

from hetmoe.loading.hub import record_path
from hetmoe.loading.hub_names import (
    RepoFile,
    checkpoint_files,
    gguf_quant,
    gguf_quants,
    model_files,
    parse_hub_name,
)


def test_names_parse_as_users_type_them() -> None:
    plain, main = parse_hub_name("Qwen/Qwen3-30B-A3B"), parse_hub_name("Qwen/Qwen3-30B-A3B@main")
    assert plain is not None and main is not None and plain.ref == main.ref == "main"
    assert record_path(plain) == record_path(main)  # one cache record for both
    name = parse_hub_name("unsloth/Qwen3-30B-A3B-GGUF@v2:Q4_K_M")
    assert name is not None and (name.repo_id, name.revision, name.quant) == (
        "unsloth/Qwen3-30B-A3B-GGUF", "v2", "Q4_K_M")
    assert str(name) == "unsloth/Qwen3-30B-A3B-GGUF@v2:Q4_K_M"
    for not_a_name in ("./org/name", "/abs/path", "~/m", "org/name.gguf", "tiny-qwen3-moe",
                       "a/b/c", "org/bad--name", "org/name:"):
        assert parse_hub_name(not_a_name) is None, not_a_name


def test_quant_labels_and_splits() -> None:
    assert gguf_quant("Qwen3-30B-A3B-Q4_K_M.gguf") == "Q4_K_M"
    assert gguf_quant("UD-Q4_K_XL/Qwen3-30B-A3B-UD-Q4_K_XL-00001-of-00002.gguf") == "UD-Q4_K_XL"
    assert gguf_quant("model.IQ4_XS.gguf") == "IQ4_XS"
    assert gguf_quant("Qwen3-30B-A3B-BF16.gguf") == "BF16"
    files = [RepoFile("m-Q6_K-00002-of-00002.gguf", 2), RepoFile("m-Q6_K-00001-of-00002.gguf", 3),
             RepoFile("mmproj-F16.gguf", 1), RepoFile("m-Q8_0.gguf", 9)]
    quants = gguf_quants(files)
    assert sorted(quants) == ["Q6_K", "Q8_0"]
    assert [f.path for f in quants["Q6_K"]] == ["m-Q6_K-00001-of-00002.gguf",
                                                 "m-Q6_K-00002-of-00002.gguf"]
    with pytest.raises(ValueError, match=r"GGUF quant Q6_K: its files are not one complete "
                                         r"split .*m-Q6_K-00001-of-00003.gguf"):
        gguf_quants([RepoFile("m-Q6_K-00001-of-00003.gguf", 1),
                     RepoFile("m-Q6_K-00002-of-00003.gguf", 1)])


def test_a_safetensors_repo_fetches_the_model_files_only() -> None:
    names = ["config.json", "tokenizer.json", "chat_template.jinja", "README.md",
             "model.safetensors.index.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "consolidated.safetensors",
             "original/model.safetensors", "pytorch_model.bin", "model-Q4_K_M.gguf"]
    files = [RepoFile(n, 1) for n in names]
    assert [f.path for f in checkpoint_files(files)] == names[:3] + names[4:7]
    name = parse_hub_name("org/m")
    assert name is not None
    chosen, quant, note = model_files(name, files, free=10)
    assert (len(chosen), quant, note) == (6, None, None)


def test_repos_without_a_model_and_quants_of_safetensors_repos_are_refused() -> None:
    text = [RepoFile("README.md", 10), RepoFile("LICENSE", 5)]
    with pytest.raises(ValueError, match=r"org/m: neither safetensors weights \(config.json and "
                                         r"model\*.safetensors\) nor GGUF files in the repo "
                                         r"\(found: README.md, LICENSE\)"):
        model_files(parse_hub_name("org/m"), text, free=10)  # type: ignore[arg-type]
    weights = [RepoFile("config.json", 1), RepoFile("model.safetensors", 9)]
    with pytest.raises(ValueError, match="org/m:Q4_K_M: `:Q4_K_M` picks a GGUF quant; org/m has "
                                         "no GGUF files"):
        model_files(parse_hub_name("org/m:Q4_K_M"), weights, free=10)  # type: ignore[arg-type]
