"""Chat templates kvmesh ships, and loading one by name, path or text."""

from __future__ import annotations

from pathlib import Path

_BUNDLED_DIR = Path(__file__).parent


def bundled_chat_templates() -> list[str]:
    """Names of the templates shipped here (file names without ".jinja")."""
    return sorted(path.stem for path in _BUNDLED_DIR.glob("*.jinja"))


def load_chat_template(name_or_path: str) -> str:
    """The text of a chat template given as a bundled name ("smollm2_tools"),
    a file path, or the template text itself (anything containing "{%" or "{{").

    Raises ValueError when it is none of these.
    """
    if "{%" in name_or_path or "{{" in name_or_path:
        return name_or_path
    if name_or_path in bundled_chat_templates():
        return (_BUNDLED_DIR / f"{name_or_path}.jinja").read_text()
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path.read_text()
    raise ValueError(
        f"chat template {name_or_path!r} is neither a bundled template "
        f"({', '.join(bundled_chat_templates())}), a file, nor template text"
    )
