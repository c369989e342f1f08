"""``python -m overmind_lab._launcher -f CONNECTION_FILE``: the warm kernelspec's argv."""

from overmind_lab._launcher.stand_in import main

main()
