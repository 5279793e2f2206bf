"""`LLM(..., chat_template=FILE)`: the file replaces the checkpoint's template; a missing,
undecodable, empty or invalid file is a ValueError naming it, raised before the model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetmoe import LLM
from hetmoe.engine import engine
from hetmoe.engine.model.chat_template import read_chat_template, set_chat_template

TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}")


def test_the_file_replaces_the_checkpoints_template(tiny_dir, tmp_path: Path) -> None:
    file = tmp_path / "plain.jinja"
    file.write_text(TEMPLATE)
    llm = LLM(tiny_dir("qwen3_moe"), device="cpu", experts="torch", progress=False,
              max_seq_len=64, chat_template=file)
    ids = llm.chat_prompt([{"role": "user", "content": "Hello"}])
    assert llm.tokenizer.decode(ids) == "<s>[USER] Hello\n[ASSISTANT] "
    assert llm.chat([{"role": "user", "content": "Hello"}], max_new_tokens=2).prompt_tokens == \
        len(ids)


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file"),
    (b"\xff\xfe{{ x }}", "not UTF-8 text (byte 0)"),
    (b"  \n", "the file is empty"),
    (b"{% for m in messages %}{{ m }", "not a valid Jinja template (line 1): unexpected '}'"),
    (b"{{ x | no_such_filter }}", "not a valid Jinja template (line 1): No filter named"),
])
def test_bad_files_are_named_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            content: bytes | None, message: str) -> None:
    file = tmp_path / "t.jinja"
    if content is not None:
        file.write_bytes(content)

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was opened before the template was checked")

    monkeypatch.setattr(engine, "open_model", never)
    with pytest.raises(ValueError) as caught:
        LLM("any-model", device="cpu", chat_template=file)
    assert str(caught.value).startswith(f"chat template {str(file)!r}: {message}")
    with pytest.raises(ValueError, match="is a directory"):
        read_chat_template(tmp_path)


def test_a_model_without_tokenizer_refuses_the_template(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"chat template 'chat.jinja': .*model has no tokenizer "
                                         r"to render it with"):
        set_chat_template(None, "{{ messages }}", "chat.jinja", tmp_path / "model")

    class Tokenizer:
        chat_template = "old"

    tokenizer = Tokenizer()
    set_chat_template(tokenizer, "{{ messages }}", "chat.jinja", tmp_path / "model")
    assert tokenizer.chat_template == "{{ messages }}"
