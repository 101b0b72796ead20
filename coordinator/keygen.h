/* coordinator/keygen.h: the `k3-coordinator keygen` subcommand.
 *
 * Owns: the command line that writes a CURVE key pair for the cluster
 * transport (proto/link.h): PREFIX.key (public + secret, mode 0600, never
 * overwritten) and PREFIX.pub (public only). Coordinators load the .key with
 * --curve-secret; workers list coordinator .pub keys in their --allow file;
 * workers' own .key files are made the same way and their public keys go in
 * the coordinator's --worker-keys file. Borrows: nothing.
 * Called from main() (single thread) with argv[0] = "keygen".
 *
 *   k3-coordinator keygen PREFIX
 *
 * Prints the public key (Z85) on stdout; never prints the secret. Returns
 * the process exit code: 0 ok, 1 error (message on stderr), 2 usage.
 */
#ifndef K3_KEYGEN_H
#define K3_KEYGEN_H

int cmd_keygen(int argc, char **argv);

#endif
