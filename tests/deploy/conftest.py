"""Fixtures for the deployment tests: the image built once per session (scripts/image.sh; its
build log in the session's temp directory) and its root file system mounted per module.
The image tests need root (buildah); without it they are skipped, as the netns tests are."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.image import BuiltImage, build, mounted


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root to build and mount the image")
    for item in items:
        if "image" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def built_image(tmp_path_factory: pytest.TempPathFactory) -> BuiltImage:
    return build(tmp_path_factory.mktemp("image") / "build.log")


@pytest.fixture(scope="module")
def image_rootfs(built_image: BuiltImage) -> Iterator[Path]:
    with mounted(built_image.tag) as root:
        yield root
