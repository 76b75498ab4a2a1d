// The partition the Kafka Java client's default partitioner picks for a keyed
// record: toPositive(murmur2(keyBytes)) % numPartitions. Utils.murmur2 and
// Utils.toPositive are transcribed from org.apache.kafka.common.utils.Utils
// (Apache Kafka, Apache License 2.0); BuiltInPartitioner.partitionForKey uses
// them for every record that has a key.
//
// Usage: java KafkaPartition.java <partitions> < keys
// Input: one key per line, its bytes in hex ("-" for an empty key).
// Output: per key, in the same order, "<murmur2> <partition>".

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;

public class KafkaPartition {
    // org.apache.kafka.common.utils.Utils.murmur2
    public static int murmur2(final byte[] data) {
        int length = data.length;
        int seed = 0x9747b28c;
        // MurmurHash2's mixing constants.
        final int m = 0x5bd1e995;
        final int r = 24;

        int h = seed ^ length;
        int length4 = length / 4;

        for (int i = 0; i < length4; i++) {
            final int i4 = i * 4;
            int k = (data[i4 + 0] & 0xff) + ((data[i4 + 1] & 0xff) << 8) + ((data[i4 + 2] & 0xff) << 16) + ((data[i4 + 3] & 0xff) << 24);
            k *= m;
            k ^= k >>> r;
            k *= m;
            h *= m;
            h ^= k;
        }

        // The last one to three bytes (the cases fall through, as in Kafka).
        switch (length % 4) {
            case 3:
                h ^= (data[(length & ~3) + 2] & 0xff) << 16;
            case 2:
                h ^= (data[(length & ~3) + 1] & 0xff) << 8;
            case 1:
                h ^= data[length & ~3] & 0xff;
                h *= m;
        }

        h ^= h >>> 13;
        h *= m;
        h ^= h >>> 15;

        return h;
    }

    // org.apache.kafka.common.utils.Utils.toPositive
    public static int toPositive(int number) {
        return number & 0x7fffffff;
    }

    // org.apache.kafka.clients.producer.internals.BuiltInPartitioner.partitionForKey
    public static int partitionForKey(final byte[] serializedKey, final int numPartitions) {
        return toPositive(murmur2(serializedKey)) % numPartitions;
    }

    public static void main(String[] args) throws Exception {
        int partitions = Integer.parseInt(args[0]);
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.US_ASCII));
        StringBuilder out = new StringBuilder();
        String line;
        while ((line = in.readLine()) != null) {
            byte[] key = new byte[line.equals("-") ? 0 : line.length() / 2];
            for (int i = 0; i < key.length; i++) {
                key[i] = (byte) Integer.parseInt(line.substring(2 * i, 2 * i + 2), 16);
            }
            out.append(murmur2(key)).append(' ').append(partitionForKey(key, partitions)).append('\n');
        }
        System.out.print(out);
    }
}
