"""Operations: the command line, metrics and the demo."""
