"""The router's side of images, in process (router/completions/images.py): the prompt it makes
of a chat with images equals transformers' Gemma3Processor's and DeepseekVLProcessor's (their
chat templates and their widening of each image's begin or placeholder token); a template
that reads strings gets the begin token's text; URLs are read only where the operator allows
(a symlink out of the allowed directory, a redirect from an allowed host and an oversized
remote file are refused)."""

from __future__ import annotations

import asyncio
import base64
import functools
import http.server
import io
import json
import threading

import pytest
import transformers
from PIL import Image

from router.completions import images
from router.completions.protocol import ChatMessage
from router.errors import APIError
from services.launcher import free_port
from services.model.loading.hf_config import read_config
from services.settings import DEFAULTS
from services.tokenizer.tokenizer import Tokenizer
from tests.support.tiny_deepseek_vl import save_tiny_deepseek_vl
from tests.support.tiny_vision import picture, save_tiny_gemma3_vision


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, embedded_dir):
    path = tmp_path_factory.mktemp("gemma3-vision")
    save_tiny_gemma3_vision(path, embedded_dir)
    return path


@pytest.fixture(scope="module")
def deepseek_vl(tmp_path_factory, embedded_dir):
    path = tmp_path_factory.mktemp("deepseek-vl")
    save_tiny_deepseek_vl(path, embedded_dir, "llama")
    return path


def router_prompt(checkpoint, messages: list[dict]) -> list[int]:
    """What prepare_chat makes of the messages (rendered, widened, tokenized)."""
    tokenizer, vision = Tokenizer.from_dir(checkpoint), read_config(checkpoint).vision
    parsed = [ChatMessage.model_validate(m) for m in messages]
    text_of_image = images.image_text(tokenizer, vision)
    rendered = tokenizer.render_chat([m.as_template_input(text_of_image) for m in parsed])
    count = sum(len(m.images) for m in parsed)
    return tokenizer.encode(images.expand(rendered, tokenizer, vision, count), False)


@pytest.mark.parametrize("family", ["gemma3", "deepseek_vl"])
def test_the_prompt_equals_the_models_processors(family, request):
    """Two turns, two images, text around them: the ids transformers' processor gives for the
    same conversation and images."""
    checkpoint = request.getfixturevalue("checkpoint" if family == "gemma3" else family)
    url = "data:image/png;base64," + base64.b64encode(picture(1)).decode()
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                     {"type": "image_url", "image_url": {"url": url}}]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": " and this one, compared?"}]},
    ]  # fmt: skip
    processor = transformers.AutoProcessor.from_pretrained(str(checkpoint))
    theirs_messages = [
        {"role": m["role"], "content": [
            {"type": "image"} if p["type"] == "image_url" else p for p in m["content"]
        ] if isinstance(m["content"], list) else m["content"]}
        for m in messages
    ]  # fmt: skip
    text = processor.apply_chat_template(theirs_messages, add_generation_prompt=True)
    pictures = [Image.open(io.BytesIO(picture(1))), Image.open(io.BytesIO(picture(1)))]
    theirs = processor(text=text, images=pictures, return_tensors="np")["input_ids"][0].tolist()
    assert router_prompt(checkpoint, messages) == theirs


def test_a_template_of_strings_gets_the_begin_tokens_text(checkpoint, tmp_path):
    """A chat template that never mentions images reads a message as a string: the image's
    place is its begin token's text, widened as for any template."""
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in checkpoint.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    config = (plain / "tokenizer_config.json").read_text()
    data = json.loads(config) | {"chat_template": template}
    (plain / "tokenizer_config.json").write_text(json.dumps(data))
    (plain / "chat_template.jinja").write_text(template)
    url = "data:image/png;base64," + base64.b64encode(picture(2)).decode()
    parts = [{"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": url}}]
    ids = router_prompt(plain, [{"role": "user", "content": parts}])
    tokenizer = Tokenizer.from_dir(plain)
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith(
        "[user] see \n\n<start_of_image><image_soft_token>"
    )


def settings(**changes):
    return DEFAULTS.router.__class__(**{**DEFAULTS.router.__dict__, **changes})


def read(url: str, **changes) -> bytes:
    place = images.Place("messages.0.content.0.image_url", images.ImageUrl(url=url))
    return asyncio.run(images.read(settings(**changes), place))


def test_a_symlink_out_of_the_allowed_directory_is_refused(tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "secret.png"
    allowed.mkdir()
    outside.write_bytes(picture(3))
    (allowed / "link.png").symlink_to(outside)
    (allowed / "own.png").write_bytes(picture(4))
    assert read(f"file://{allowed}/own.png", allowed_local_media_path=str(allowed)) == picture(4)
    with pytest.raises(APIError, match="outside the allowed media directory"):
        read(f"file://{allowed}/link.png", allowed_local_media_path=str(allowed))
    with pytest.raises(APIError, match="allowed-local-media-path"):
        read(f"file://{allowed}/own.png")  # no directory allowed: none read


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    """An HTTP server on 127.0.0.1: /small.png, /big.png and /moved (a redirect)."""
    root = tmp_path_factory.mktemp("web")
    (root / "small.png").write_bytes(picture(5))
    (root / "big.png").write_bytes(picture(6) + bytes(50_000))

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "/small.png")
                self.end_headers()
                return
            super().do_GET()

    handler = functools.partial(Handler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_remote_urls_only_from_allowed_hosts_no_redirects_no_more_than_the_limit(web):
    allowed = {"allowed_media_domains": ("127.0.0.1",)}
    assert read(f"{web}/small.png", **allowed) == picture(5)
    with pytest.raises(APIError, match=r"refused \(127\.0\.0\.1 is not among"):
        read(f"{web}/small.png")
    with pytest.raises(APIError, match="answered 302"):
        read(f"{web}/moved", **allowed)
    with pytest.raises(APIError, match="over 20000 bytes"):
        read(f"{web}/big.png", max_image_bytes=20_000, **allowed)
    with pytest.raises(APIError, match="data:, file: or http"):
        read("ftp://127.0.0.1/x.png", **allowed)
