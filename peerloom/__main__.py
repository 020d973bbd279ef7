from peerloom.cli import main

main()
