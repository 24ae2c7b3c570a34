from pdctl import supervisor

supervisor.hold_signals()  # before the CLI's imports: a stop while they load is acted on

from pdctl.cli import main  # noqa: E402

main()
