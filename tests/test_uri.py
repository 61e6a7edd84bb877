"""`hf://` locations are parsed in one place (`ckpt_cli.storage.uri`, issue #26): the CLI's `--revision` /
`--repo-type` options fold into the URL through the same parser that reads it."""

from __future__ import annotations

import pytest

from ckpt_cli.errors import UsageError
from ckpt_cli.storage.uri import hub_url, is_hub_url, parse_location, with_hub_options


@pytest.mark.parametrize(
    "text",
    [
        "hf://org/model",
        "hf://datasets/org/data@v1/sub/dir",
        "hf://spaces/org/app",
        "hf://org/model@refs%2Fpr%2F1/unet",
    ],
)
def test_a_hub_url_reads_back_as_the_same_location(text: str) -> None:
    location = parse_location(text)
    assert hub_url(location) == text
    assert parse_location(hub_url(location)) == location


def test_the_hub_scheme_is_told_the_way_the_parser_tells_it() -> None:
    assert is_hub_url("hf://org/model") and is_hub_url("HF://org/model")
    assert parse_location("HF://org/model").kind == "hf"
    assert not is_hub_url("org/model") and not is_hub_url("s3://bucket/hf://x")
    assert not is_hub_url("./hf://x")


@pytest.mark.parametrize(
    ("text", "revision", "repo_type", "folded"),
    [
        ("hf://org/model", None, None, "hf://org/model"),
        ("hf://org/model", "v1", None, "hf://org/model@v1"),
        ("hf://org/model/sub", "refs/pr/1", None, "hf://org/model@refs%2Fpr%2F1/sub"),
        ("hf://org/model@v1", "v1", None, "hf://org/model@v1"),
        # the URL's revision is compared decoded, as the parser reads it
        ("hf://org/model@refs%2Fpr%2F1", "refs/pr/1", None, "hf://org/model@refs%2Fpr%2F1"),
        ("hf://org/data", None, "dataset", "hf://datasets/org/data"),
        ("hf://datasets/org/data", "main", "dataset", "hf://datasets/org/data@main"),
        ("hf://models/org/model", None, "model", "hf://org/model"),
        ("HF://org/model", "v1", None, "hf://org/model@v1"),
    ],
)
def test_hub_options_fold_into_the_url(
    text: str, revision: str | None, repo_type: str | None, folded: str
) -> None:
    assert with_hub_options(text, revision, repo_type) == folded


@pytest.mark.parametrize(
    ("text", "revision", "repo_type", "message"),
    [
        ("./model", "v1", None, "--revision applies to a Hub location"),
        ("s3://b/run", "v1", "model", "--revision and --repo-type apply to a Hub location"),
        ("hf://org/model", None, "notebook", "is not a repository type"),
        ("hf://datasets/org/data", None, "space", "--repo-type space contradicts"),
        ("hf://org/model@v1", "v2", None, "--revision v2 contradicts"),
        ("hf://org", "v1", None, "is not a Hub location"),
    ],
)
def test_hub_options_that_cannot_fold_are_usage_errors(
    text: str, revision: str | None, repo_type: str | None, message: str
) -> None:
    with pytest.raises(UsageError, match=message) as raised:
        with_hub_options(text, revision, repo_type)
    assert raised.value.exit_code == 2
