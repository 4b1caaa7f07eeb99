from ragspeed.cli import main

main()
