"""The static post-mortem site: `build` executes every notebook (`execute`), renders and indexes
it and swaps it in; `usage` states the facts of the "Use the fixed kernel" page and `pasteblocks`
what a page invites a reader to paste.
"""
