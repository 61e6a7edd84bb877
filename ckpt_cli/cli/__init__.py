"""The face: the typer app, its conventions, one module per command, and the renderers.

Only this package writes to the terminal; everything below it returns reports."""
