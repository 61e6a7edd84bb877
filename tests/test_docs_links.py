"""`ckpt --help` and every command's help end with a link to their page of the docs site, and
every page linked exists in docs/ and in the site's navigation."""

from __future__ import annotations

import re

import typer.main

from ckpt_cli.cli.app import get_app
from ckpt_cli.cli.conventions import DOCS_URL, command_docs_url, docs_url

from .conftest import REPO, run_ckpt, run_ckpt_process


def command_names() -> list[str]:
    group = typer.main.get_command(get_app())
    return sorted(group.commands)  # type: ignore[attr-defined]


def page_of(url: str) -> str:
    """The docs/ file mkdocs serves at `url` (directory URLs: `commands/x/` is commands/x.md)."""
    assert url.startswith(DOCS_URL), url
    path = url[len(DOCS_URL) :].strip("/")
    return f"{path}.md" if path else "index.md"


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1].strip()


def test_every_command_help_ends_with_its_page_and_the_page_exists() -> None:
    names = command_names()
    assert {"inspect", "verify", "convert", "reshard", "prune", "doctor"} <= set(names)
    nav = (REPO / "mkdocs.yml").read_text()
    for name in names:
        result = run_ckpt(name, "--help")
        assert result.exit_code == 0, name
        url = command_docs_url(name)
        assert last_line(result.stdout) == f"Documentation: {url}", name
        page = page_of(url)
        assert (REPO / "docs" / page).is_file(), f"ckpt {name} --help links to a missing {page}"
        assert re.search(rf":\s*{re.escape(page)}\s*$", nav, re.M), f"{page} is not in the nav"


def test_the_root_help_links_to_the_site_from_a_real_process() -> None:
    result = run_ckpt_process("--help")
    assert result.exit_code == 0
    assert last_line(result.stdout) == f"Documentation: {docs_url()}"
    assert (REPO / "docs" / page_of(docs_url())).is_file()


def test_the_docs_url_is_the_sites_own() -> None:
    # one base URL: the CLI's and the one mkdocs publishes the site under agree
    site_url = re.search(r"^site_url:\s*(\S+)\s*$", (REPO / "mkdocs.yml").read_text(), re.M)
    assert site_url is not None and site_url.group(1) == DOCS_URL


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readmes_links_reach_existing_pages_and_headings() -> None:
    # mkdocs checks the links of docs/; the README is outside the site, so it is checked here
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert len(local) > 20
    for link in local:
        path, _, anchor = link.partition("#")
        target = REPO / path if path else REPO / "README.md"
        assert target.is_file(), f"README links to a missing {path}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {github_anchor(h) for h in headings}, f"no #{anchor} in {path}"
