"""The word-piece tokenizer: lossless, stable ids, and prompt accounting that agrees with encode."""

from __future__ import annotations

import zlib

import pytest

from serve_app import tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines",
    "naïve café — ünïcödé 你好",
    "x=1+2; y = [a, b]  # comment",
    "<|im_start|> user\nhi <|im_end|>",
    "a",
]


@pytest.mark.parametrize("text", TEXTS)
def test_join_of_tokens_is_the_text(text):
    assert "".join(tokenizer.tokenize(text)) == text


def test_trailing_whitespace_is_dropped():
    assert "".join(tokenizer.tokenize("hi there \n")) == "hi there"


def test_pieces_carry_the_whitespace_before_them():
    assert tokenizer.tokenize("Hello, big world!") == ["Hello", ",", " big", " world", "!"]


@pytest.mark.parametrize("marker", ["<|im_start|>", "<|im_end|>"])
def test_special_markers_are_one_token(marker):
    assert tokenizer.tokenize(f"a{marker} b") == ["a", marker, " b"]
    assert tokenizer.tokenize(f" {marker}") == [f" {marker}"]


def test_other_angle_bar_text_is_not_special():
    assert len(tokenizer.tokenize("<|im_middle|>")) > 1


@pytest.mark.parametrize("text", [*TEXTS, "", "   "])
def test_count_tokens_equals_len_encode(text):
    assert tokenizer.count_tokens(text) == len(tokenizer.encode(text))


def test_empty_text_has_no_tokens():
    assert tokenizer.tokenize("") == []


def test_token_id_is_stable_crc32():
    # The same in every process and every run (Python's hash() is salted; this must not be).
    assert tokenizer.token_id(" world") == zlib.crc32(b" world") & 0x7FFFFFFF
    assert tokenizer.token_id("hello") == 907060870
    assert 0 <= tokenizer.token_id("<|im_end|>") < 2**31


def test_encode_maps_pieces_to_ids():
    assert tokenizer.encode("Hi you") == [tokenizer.token_id("Hi"), tokenizer.token_id(" you")]


def test_render_chat_uses_chatml_and_ends_with_assistant_turn():
    text = tokenizer.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text == (
        "<|im_start|> system\nBe brief. <|im_end|>\n"
        "<|im_start|> user\nHi <|im_end|>\n"
        "<|im_start|> assistant\n"
    )


def test_render_chat_keeps_text_content_parts():
    text = tokenizer.render_chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look "},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    {"type": "text", "text": "here"},
                ],
            }
        ]
    )
    assert "Look \nhere" in text  # joined as vLLM joins text parts for a string template
    assert "http://x" not in text
    assert text.endswith("<|im_start|> assistant\n")


def test_render_chat_null_content_and_default_role():
    text = tokenizer.render_chat([{"content": None}])
    assert text.startswith("<|im_start|> user\n <|im_end|>\n")


def test_rendered_markers_count_as_single_tokens():
    text = tokenizer.render_chat([{"role": "user", "content": "hi"}])
    # <|im_start|>, " user", "\nhi", " <|im_end|>", "\n<|im_start|>", " assistant"
    assert tokenizer.count_tokens(text) == 6


def test_output_words_are_single_tokens():
    for word in tokenizer.OUTPUT_WORDS:
        assert tokenizer.tokenize(word) == [word]
