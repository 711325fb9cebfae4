from irismesh._exit import end_process
from irismesh.cli import main

end_process(main())
