from cuattn.cli import main

raise SystemExit(main())
