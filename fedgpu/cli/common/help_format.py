"""Help that shows on/off options as flags: `--json`, not `--json <bool>`.

typer 0.29 renders a value type beside every option in its rich help, flags included:
`TyperOption.display_type_rich` returns the metavar, else `<bool>` for a bool, and the
options panel prints whatever it returns. A flag takes no value, so it should show none.
app.py calls `show_flags_as_flags()` once, before any help is rendered; typer versions without
that method (older ones print no type for flags) are left as they are.
"""

from __future__ import annotations

from typing import Any

from typer import core


def show_flags_as_flags() -> None:
    option = core.TyperOption
    original = getattr(option, "display_type_rich", None)
    if original is None or getattr(original, "_fedgpu_flags", False):
        return

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        # A flag (--json, --follow/--no-follow, --help) takes no value: no type to show.
        if getattr(self, "is_flag", False) and getattr(self, "metavar", None) is None:
            return None
        return original(self, ctx)  # type: ignore[no-any-return]

    display_type_rich._fedgpu_flags = True  # type: ignore[attr-defined]
    option.display_type_rich = display_type_rich  # type: ignore[method-assign]
