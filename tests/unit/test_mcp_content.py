"""What a model reads from an execution result: sections in one text, images as images."""

from __future__ import annotations

from mcp_types import ImageContent, TextContent

from mcp_forge.gateway.mcp.content import execution_content, sniff_image
from mcp_forge.jupyter.execution import ErrorInfo, ExecutionResult


def test_output_result_and_error_are_separate_sections() -> None:
    result = ExecutionResult(
        status="error",
        stdout="out\n",
        stderr="warn\n",
        result={"data": {"text/plain": "42"}, "metadata": {}},
        error=ErrorInfo("ValueError", "bad", ("Traceback", "ValueError: bad")),
    )
    (block,) = execution_content(result)
    assert isinstance(block, TextContent)
    assert block.text.split("\n\n") == [
        "[stdout]\nout",
        "[stderr]\nwarn",
        "[result]\n42",
        "[error]\nTraceback\nValueError: bad",
    ]


def test_images_become_image_content_and_their_text_is_not_repeated() -> None:
    figure = {"data": {"image/png": "iVBORw0K\n", "text/plain": "<Figure>"}, "metadata": {}}
    table = {"data": {"text/markdown": "| a |"}, "metadata": {}}
    blocks = execution_content(ExecutionResult(status="ok", displays=(figure, table)))
    text, image = blocks
    assert isinstance(text, TextContent) and "<Figure>" not in text.text
    assert "[display]\n| a |" in text.text
    assert isinstance(image, ImageContent)
    assert (image.mime_type, image.data) == ("image/png", "iVBORw0K")


def test_a_silent_success_says_so() -> None:
    (block,) = execution_content(ExecutionResult(status="ok"))
    assert isinstance(block, TextContent) and block.text == "[ok] (no output)"


def test_timeouts_say_what_happened() -> None:
    r = ExecutionResult(status="timeout", message="interrupted; variables are kept")
    (block,) = execution_content(r)
    assert isinstance(block, TextContent)
    assert block.text.endswith("[timeout] interrupted; variables are kept")


def test_images_are_recognised_by_their_bytes() -> None:
    assert sniff_image(b"\x89PNG\r\n\x1a\nrest") == "image/png"
    assert sniff_image(b"\xff\xd8\xff\xe0") == "image/jpeg"
    assert sniff_image(b"GIF89a...") == "image/gif"
    assert sniff_image(b"RIFF1234WEBPVP8 ") == "image/webp"
    assert sniff_image(b"plain text") is None
