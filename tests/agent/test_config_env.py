"""The process environment an instance gets: image env, then the env's variables and secrets, then the
platform's own variables (which configuration cannot shadow)."""

from __future__ import annotations

from pathlib import Path

from zattera.v1 import types_pb2 as pb

from services.agent.images import PreparedImage
from services.agent.instance_env import instance_env


def test_config_overrides_the_image_and_the_platform_overrides_config() -> None:
    a = pb.Assignment(node_id="n1", environment_id="E1", release_id="R1")
    a.meta.id = "A1"
    image = PreparedImage(ref="img", workdir=Path("/tmp"), env={"LANG_LEVEL": "image", "KEEP": "image"})
    config = {"LANG_LEVEL": "config", "API_TOKEN": "t", "PORT": "1", "ZATTERA_NODE_ID": "forged"}
    env = instance_env(a, image, {"http": 8080}, {}, config)
    assert env["LANG_LEVEL"] == "config" and env["KEEP"] == "image" and env["API_TOKEN"] == "t"
    assert env["PORT"] == "8080" and env["ZATTERA_NODE_ID"] == "n1"
