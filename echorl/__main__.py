"""`python -m echorl ...` is `echorl ...` (and `torchrun -m echorl trainer ...` a trainer world)."""

from echorl.cli import main

main()
