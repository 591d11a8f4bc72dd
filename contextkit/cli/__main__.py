from contextkit.cli import main

main()
