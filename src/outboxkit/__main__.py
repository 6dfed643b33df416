from outboxkit.ops.cli import main

main()
