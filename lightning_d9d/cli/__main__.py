from lightning_d9d.cli import main

main()
