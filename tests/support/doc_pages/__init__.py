"""What the guide pages' snippets assume of the reader's project (test_doc_pages.py)."""
