"""The chart README's values table is generated from values.yaml's `# --` comments
(deploy/helm/values_table.py) and up to date; every `# --` comment documents a key."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("values_table", ROOT / "deploy" / "helm" / "values_table.py")
values_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(values_table)


def test_the_readme_values_table_is_generated_from_values_yaml() -> None:
    readme = values_table.README.read_text()
    assert values_table.updated_readme(readme, values_table.VALUES.read_text()) == readme, (
        "deploy/helm/README.md's values table differs from values.yaml's `# --` comments; run .venv/bin/python deploy/helm/values_table.py"
    )


def test_every_comment_documents_a_key() -> None:
    text = values_table.VALUES.read_text()
    comments = sum(line.strip().startswith("# --") for line in text.splitlines())
    rows = values_table.documented_keys(text)
    assert len(rows) == comments and all(description for _, description in rows)
    assert len({key for key, _ in rows}) == len(rows), "a key documented twice"


def test_a_changed_comment_shows_in_the_table() -> None:
    text = "image:\n  # -- The image.\n  # Second line.\n  repository: x\nlist:\n  # -- Item name.\n  - name: a\n"
    assert values_table.documented_keys(text) == [("image.repository", "The image. Second line."), ("list[].name", "Item name.")]
    assert '| `image.repository` | `"x"` | The image. Second line. |' in values_table.table(text)
