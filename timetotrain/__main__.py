from timetotrain.cli import main

raise SystemExit(main())
