"""What docs/testing-your-code.md's snippets assume of "your code" (tests/integration/test_doc_pages.py)."""
