/* coordinator/cmd_web.c: `k3-coordinator web` (cmd_web.h). */
#include "coordinator/cmd_web.h"

#include <stdio.h>
#include <string.h>

#include "coordinator/serve.h"
#include "coordinator/serve_web.h"

int cmd_web(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("k3-coordinator web: `serve` with the chat page at http://HOST:PORT/; it takes\n"
                   "serve's options and prints the page's URL when it is ready (docs/WEB.md).\n\n");
            break;
        }
    serve_web_set_announce(1);
    return cmd_serve(argc, argv);
}
