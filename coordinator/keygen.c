/* coordinator/keygen.c: `k3-coordinator keygen PREFIX` (keygen.h). */
#include "coordinator/keygen.h"

#include <stdio.h>
#include <string.h>

#include "proto/link.h"

int cmd_keygen(int argc, char **argv) {
    if (argc == 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        printf("usage: k3-coordinator keygen PREFIX\n"
               "Writes a CURVE key pair for the cluster transport: PREFIX.key (public and\n"
               "secret, mode 0600; give it to --curve-secret) and PREFIX.pub (the public key,\n"
               "for a worker's --allow file or the coordinator's --worker-keys file).\n"
               "Existing files are never overwritten. Prints the public key.\n");
        return 0;
    }
    if (argc != 2 || argv[1][0] == '-') {
        fprintf(stderr, "k3-coordinator keygen: expected one argument, the output PREFIX "
                        "(see keygen --help)\n");
        return 2;
    }
    char err[512];
    k3_curve_keypair kp;
    k3_status st = k3_link_keygen(argv[1], &kp, err, sizeof err);
    if (st) {
        fprintf(stderr, "k3-coordinator keygen: %s\n", err);
        return 1;
    }
    printf("%s\n", kp.public_z85);
    fprintf(stderr, "k3-coordinator keygen: wrote %s.key (mode 0600) and %s.pub\n", argv[1],
            argv[1]);
    memset(&kp, 0, sizeof kp);
    return 0;
}
