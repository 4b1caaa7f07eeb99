from ragspeed.gateway.cli import main

main()
